"""vLLM patches, one module per vLLM target: each declares `SYMBOLS` (what it touches) and
`apply(set_)` (its wrappers, installed through `_compat`'s undoable setter)."""
