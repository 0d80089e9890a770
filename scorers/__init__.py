"""Scorers: target-side verification of drafts (tree packing, tree attention, acceptance)."""
from .tree import (
    AcceptResult,
    DraftTree,
    PackedTrees,
    coupled_accept,
    greedy_accept,
    greedy_chain,
    pack_trees,
    reference_tree_attention,
    row_argmax,
    sampled_accept,
    tree_attention_bias,
    verify_batch,
)

__all__ = [
    "AcceptResult", "DraftTree", "PackedTrees", "coupled_accept", "greedy_accept", "greedy_chain", "pack_trees",
    "reference_tree_attention", "row_argmax", "sampled_accept", "tree_attention_bias", "verify_batch",
]
