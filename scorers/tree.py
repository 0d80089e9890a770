"""Draft-tree verification core (SpecInfer / Sequoia style), engine-agnostic.

Row convention (used by masks, logits and acceptance): a tree with n nodes has 1 + n rows.
Row 0 is the root = the last committed token, which is fed this step; row 1 + i is node i.
`target_logits[0]` predicts the depth-1 tokens, `target_logits[1 + i]` the children of node i.

Position convention: `prefix_len` = tokens already in the KV cache (the root not included).
The root sits at position `prefix_len`, node i at `prefix_len + depth[i]` (root children have
depth 1). A chain therefore packs exactly like causal decoding of 1 + n tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Sequence

import numpy as np
import torch

_SAMPLING_EPS = 1e-5  # temperature below this is greedy (same as vLLM)


@dataclass(eq=False)
class DraftTree:
    """Draft tree in topological order (treat as immutable).

    tokens[i]: token of node i. parents[i]: parent node, -1 for children of the root, < i.
    draft_probs: [n, vocab] or None. Row i is the distribution node i's token was drawn from,
    i.e. q(. | parent context) -- see `sampled_accept` for what that must mean for siblings.
    None means deterministic (point-mass) drafts.
    """

    tokens: list[int]
    parents: list[int]
    draft_probs: torch.Tensor | None = None

    def __post_init__(self):
        self.tokens = [int(t) for t in self.tokens]
        self.parents = [int(p) for p in self.parents]
        n = len(self.tokens)
        if len(self.parents) != n:
            raise ValueError(f"len(tokens)={n} != len(parents)={len(self.parents)}")
        for i, (t, p) in enumerate(zip(self.tokens, self.parents)):
            if t < 0:
                raise ValueError(f"node {i}: negative token id {t}")
            if not -1 <= p < i:
                raise ValueError(f"node {i}: parent {p} violates -1 <= parent < {i} "
                                 "(nodes must be topologically ordered, -1 = root)")
        q = self.draft_probs
        if q is not None:
            if not isinstance(q, torch.Tensor) or q.dim() != 2 or q.shape[0] != n:
                shape = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
                raise ValueError(f"draft_probs must be a [num_nodes={n}, vocab] tensor, got {shape}")
            if n and max(self.tokens) >= q.shape[1]:
                raise ValueError(f"token id {max(self.tokens)} >= draft vocab {q.shape[1]}")

    @classmethod
    def from_chain(cls, tokens: Sequence[int], draft_probs: torch.Tensor | None = None) -> DraftTree:
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), draft_probs)

    @property
    def is_chain(self) -> bool:
        return is_chain(self.parents)

    def __len__(self) -> int:
        return len(self.tokens)

    @cached_property
    def depths(self) -> list[int]:
        """Depth per node; root children have depth 1."""
        d: list[int] = []
        for p in self.parents:
            d.append(1 if p < 0 else d[p] + 1)
        return d

    @property
    def max_depth(self) -> int:
        return max(self.depths, default=0)

    @cached_property
    def children(self) -> list[list[int]]:
        """children[r]: nodes whose parent is row r (0 = root, 1 + i = node i), in index order."""
        ch: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, p in enumerate(self.parents):
            ch[p + 1].append(i)
        return ch

    def path(self, i: int) -> list[int]:
        """Nodes from the root (excluded) down to node i (included)."""
        out = []
        while i >= 0:
            out.append(i)
            i = self.parents[i]
        return out[::-1]

    def paths(self) -> list[list[int]]:
        """path(i) for every node i."""
        ps: list[list[int]] = []
        for i, p in enumerate(self.parents):
            ps.append((ps[p] if p >= 0 else []) + [i])
        return ps

    def ancestor_mask(self) -> torch.Tensor:
        """[1+n, 1+n] bool: row r sees the root, its ancestors and itself."""
        n = len(self)
        m = np.zeros((n + 1, n + 1), dtype=bool)
        m[0, 0] = True
        for i, p in enumerate(self.parents):
            m[i + 1] = m[p + 1]
            m[i + 1, i + 1] = True
        return torch.from_numpy(m)


def is_chain(parents: Sequence[int]) -> bool:
    """Node i's parent is node i-1 for every node: a chain."""
    return all(p == i - 1 for i, p in enumerate(parents))


# ---------------------------------------------------------------------------------------------
# Packing + attention
# ---------------------------------------------------------------------------------------------

@dataclass
class PackedTrees:
    """A batch of trees flattened request by request: [root, node 0, ..., node n-1]."""

    input_ids: torch.Tensor        # [T] int64 (root slot = root_tokens[b], or -1 if not given)
    positions: torch.Tensor        # [T] int64: prefix_len (root), prefix_len + depth (nodes)
    depths: torch.Tensor           # [T] int64, 0 for the root
    query_start_loc: torch.Tensor  # [B+1] int32 cumulative offsets of each request's rows
    seq_lens: torch.Tensor         # [B] int32 KV length after this step: prefix_len + 1 + n
    tree_masks: list[torch.Tensor]  # per request [1+n, 1+n] bool (DraftTree.ancestor_mask)

    def block_mask(self) -> torch.Tensor:
        """[T, T] bool block-diagonal mask over the packed tree tokens (prefix not included)."""
        return torch.block_diag(*self.tree_masks).bool()


def pack_trees(trees: Sequence[DraftTree], prefix_lens: Sequence[int],
               root_tokens: Sequence[int] | None = None) -> PackedTrees:
    if len(prefix_lens) != len(trees):
        raise ValueError(f"{len(trees)} trees but {len(prefix_lens)} prefix_lens")
    if root_tokens is not None and len(root_tokens) != len(trees):
        raise ValueError(f"{len(trees)} trees but {len(root_tokens)} root_tokens")
    ids, depths, pos, sizes = [], [], [], []
    for b, (tree, plen) in enumerate(zip(trees, prefix_lens)):
        if plen < 0:
            raise ValueError(f"request {b}: prefix_len {plen} < 0")
        d = [0] + tree.depths
        ids += [-1 if root_tokens is None else int(root_tokens[b])] + tree.tokens
        depths += d
        pos += [int(plen) + x for x in d]
        sizes.append(len(d))
    qsl = torch.zeros(len(trees) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(sizes, dtype=torch.int32), 0)
    return PackedTrees(
        input_ids=torch.tensor(ids, dtype=torch.long),
        positions=torch.tensor(pos, dtype=torch.long),
        depths=torch.tensor(depths, dtype=torch.long),
        query_start_loc=qsl,
        seq_lens=torch.tensor([int(p) + s for p, s in zip(prefix_lens, sizes)], dtype=torch.int32),
        tree_masks=[t.ancestor_mask() for t in trees],
    )


def tree_attention_bias(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Additive bias: 0 where mask is True, -inf elsewhere."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def reference_tree_attention(q: torch.Tensor, k_cache_prefix: torch.Tensor, v_cache_prefix: torch.Tensor,
                             k_new: torch.Tensor, v_new: torch.Tensor, mask: torch.Tensor,
                             scale: float | None = None) -> torch.Tensor:
    """Plain attention for one request: every query sees the whole cached prefix plus the tree
    rows allowed by `mask`.

    q: [T, H, D]; k/v_cache_prefix: [P, Hkv, D]; k/v_new: [T, Hkv, D]; mask: [T, T] bool.
    GQA: query head h uses kv head h // (H // Hkv). Computed in fp32 (fp64 kept), returns q.dtype.
    """
    T, H, D = q.shape
    Hkv = k_new.shape[1]
    if H % Hkv:
        raise ValueError(f"num_heads {H} not divisible by num_kv_heads {Hkv}")
    if mask.shape != (T, T):
        raise ValueError(f"mask shape {tuple(mask.shape)} != ({T}, {T})")
    ct = torch.promote_types(q.dtype, torch.float32)
    k = torch.cat([k_cache_prefix, k_new]).to(ct).repeat_interleave(H // Hkv, dim=1)
    v = torch.cat([v_cache_prefix, v_new]).to(ct).repeat_interleave(H // Hkv, dim=1)
    full = torch.cat([mask.new_ones(T, k_cache_prefix.shape[0]), mask], dim=1)
    s = torch.einsum("qhd,khd->hqk", q.to(ct), k) * (D ** -0.5 if scale is None else scale)
    s = s.masked_fill(~full, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v).to(q.dtype)


# ---------------------------------------------------------------------------------------------
# Acceptance
# ---------------------------------------------------------------------------------------------

@dataclass
class AcceptResult:
    accepted_tokens: list[int]  # tokens of the accepted path (root excluded)
    bonus_token: int            # sampled by the target after the last accepted node
    accepted_nodes: list[int]   # node indices of the accepted path, root excluded

    @property
    def output_tokens(self) -> list[int]:
        return self.accepted_tokens + [self.bonus_token]


def _walk(tree: DraftTree, target_token: Callable[[int], int]) -> AcceptResult:
    """From the root, follow the child whose token is the target's token at the current row
    (`target_token(row)`, called once per row visited, in order; first child on duplicates)."""
    tok, ch = tree.tokens, tree.children
    row, nodes = 0, []
    while True:
        want = target_token(row)
        nxt = next((c for c in ch[row] if tok[c] == want), None)
        if nxt is None:
            return AcceptResult([tok[i] for i in nodes], want, nodes)
        nodes.append(nxt)
        row = nxt + 1


def _greedy_walk(tree: DraftTree, argmax: list[int]) -> AcceptResult:
    return _walk(tree, argmax.__getitem__)


def coupled_accept(tree: DraftTree, sample: Callable[[int], int]) -> AcceptResult:
    """Lossless acceptance of deterministic drafts (no `draft_probs`) by coupling with plain
    sampling: `sample(row)` draws the target's token for tree row `row` exactly as decoding
    without speculation would (the request's own random stream, one draw per call); it is called
    once per emitted token, in order, and the walk goes on while a child of the current node
    carries the drawn token. So the emitted tokens are the ones plain sampling emits with the same
    random stream (a seeded request gives the same output with or without speculation, whatever
    the tree), and a node is accepted with probability p(its token), as recursive rejection
    sampling does for point-mass drafts. Greedy decoding is the case sample = argmax."""
    if tree.draft_probs is not None:
        raise ValueError("coupled_accept is for deterministic drafts; use sampled_accept with draft_probs")
    return _walk(tree, sample)


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim (the first maximum, NaN above all, as torch.argmax), in fp32:
    exact for bf16/fp16 logits. On CPU through numpy, whose argmax is vectorised: ~0.05 against
    ~0.5 ms for 16 rows of a 49k vocabulary, paid by every step that verifies drafts."""
    x = (logits if logits.dtype == torch.float32 else logits.float()).detach()
    if x.device.type != "cpu":
        return x.argmax(-1)
    return torch.from_numpy(np.ascontiguousarray(x.numpy()).argmax(-1))


def greedy_chain(drafts: Sequence[int], argmax: Sequence[int]) -> list[int]:
    """The tokens greedy verification of a chain emits: its drafts while each is the target's
    argmax before it, then the argmax at the first that is not (or after the last).
    argmax: len(drafts) + 1 ids, entry i the target's after the prefix + drafts[:i]."""
    if len(argmax) != len(drafts) + 1:
        raise ValueError(f"expected {len(drafts) + 1} target ids, got {len(argmax)}")
    n = 0
    while n < len(drafts) and drafts[n] == argmax[n]:
        n += 1
    return [*drafts[:n], argmax[n]]


def greedy_accept(tree: DraftTree, target_logits: torch.Tensor | list[int]) -> AcceptResult:
    """target_logits: [1+n, vocab] logits, or the [1+n] target argmax ids (tensor or list)."""
    if len(target_logits) != len(tree) + 1:
        raise ValueError(f"expected {len(tree) + 1} target rows, got {len(target_logits)}")
    if isinstance(target_logits, list):
        return _greedy_walk(tree, target_logits)
    ids = target_logits if target_logits.dim() == 1 else row_argmax(target_logits)
    return _greedy_walk(tree, ids.tolist())


def _sample(p: np.ndarray, u: float) -> int:
    cdf = np.cumsum(p)
    i = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    return i if i < len(p) else int(np.flatnonzero(p)[-1])  # u * total rounded up to total


def sampled_accept(tree: DraftTree, target_probs: torch.Tensor, generator: torch.Generator | None = None,
                   without_replacement: bool = False) -> AcceptResult:
    """Lossless multi-draft speculative sampling (recursive rejection sampling over the tree).

    At the current node with target distribution p, children c are tried in index order: accept
    with prob min(1, p[t_c] / q_c[t_c]); on rejection p <- normalize(max(p - q_c, 0)). When all
    children are rejected (or at a leaf) the bonus token is drawn from the residual p.

    Lossless (emitted tokens ~ target, token by token) whenever q_c is the exact distribution
    child c was drawn from, given the parent context and its earlier siblings:
      * draft_probs None: deterministic drafts, q_c = one-hot(t_c) -> accept with p[t_c], on
        rejection zero p[t_c] (a later duplicate sibling then has p = 0 and is rejected).
      * siblings i.i.d. (with replacement): every sibling row is q(. | parent) -- use as given.
      * siblings drawn without replacement (SpecInfer / Sequoia): either pass the already
        adjusted rows, or pass plain q(. | parent) rows with `without_replacement=True` and the
        tokens of earlier siblings are zeroed and q renormalized here.
    Each subtree must be drafted from its own node's context only (not from acceptance outcomes).

    target_probs: [1+n, vocab] (rows renormalized here). Uses n + 1 uniforms from `generator`.
    """
    n = len(tree)
    if target_probs.dim() != 2 or target_probs.shape[0] != n + 1:
        raise ValueError(f"target_probs must be [{n + 1}, vocab], got {tuple(target_probs.shape)}")
    P = target_probs.detach().to("cpu", torch.float64).numpy()
    P = P / P.sum(1, keepdims=True)
    Q = None
    if tree.draft_probs is not None:
        Q = tree.draft_probs.detach().to("cpu", torch.float64).numpy()
        if Q.shape[1] != P.shape[1]:
            raise ValueError(f"draft vocab {Q.shape[1]} != target vocab {P.shape[1]}")
    elif n and max(tree.tokens) >= P.shape[1]:
        raise ValueError(f"token id {max(tree.tokens)} >= target vocab {P.shape[1]}")
    u = torch.rand(n + 1, generator=generator, dtype=torch.float64).tolist()
    k = 0
    tok, ch = tree.tokens, tree.children
    row, nodes = 0, []
    p = P[0]
    while True:
        tried = []
        for c in ch[row]:
            t = tok[c]
            if Q is None:
                qt = 1.0
            else:
                q = Q[c]
                if without_replacement and tried:
                    q = q.copy()
                    q[tried] = 0.0
                    s = q.sum()
                    if s <= 0:
                        raise ValueError(f"node {c}: draft_probs has no mass left after removing siblings")
                    q = q / s
                qt = q[t]
            accept = u[k] * qt < p[t]  # u < p/q, also fine for q == 0
            k += 1
            if accept:
                nodes.append(c)
                row = c + 1
                p = P[row]
                break
            if Q is None:
                r = p.copy()
                r[t] = 0.0
            else:
                r = np.maximum(p - q, 0.0)
            s = r.sum()
            if s > 0:  # s == 0 means p == q: rejection had probability 0
                p = r / s
            tried.append(t)
        else:  # no child accepted (or leaf)
            break
    return AcceptResult([tok[i] for i in nodes], _sample(p, u[k]), nodes)


def verify_batch(trees: Sequence[DraftTree], target_logits: torch.Tensor,
                 temperatures: Sequence[float] | torch.Tensor, generator: torch.Generator | None = None,
                 without_replacement: bool = False) -> list[AcceptResult]:
    """Verify a packed batch. target_logits: [T, vocab] in `pack_trees` row order.

    temperature < 1e-5 -> greedy_accept, else sampled_accept on softmax(logits / temperature).
    The generator is consumed only by sampled requests, in batch order.
    """
    sizes = [len(t) + 1 for t in trees]
    if target_logits.shape[0] != sum(sizes):
        raise ValueError(f"target_logits has {target_logits.shape[0]} rows, trees need {sum(sizes)}")
    temps = torch.as_tensor(temperatures, dtype=torch.float32).flatten().cpu()
    if temps.numel() != len(trees):
        raise ValueError(f"{len(trees)} trees but {temps.numel()} temperatures")
    greedy = (temps < _SAMPLING_EPS).tolist()
    logits = target_logits.detach().float().cpu()
    argmax = row_argmax(logits).tolist() if any(greedy) else None
    probs = None
    if not all(greedy):
        row_t = torch.repeat_interleave(torch.where(temps < _SAMPLING_EPS, 1.0, temps), torch.tensor(sizes))
        probs = torch.softmax(logits / row_t[:, None], dim=-1)
    out, s = [], 0
    for tree, g, m in zip(trees, greedy, sizes):
        if g:
            out.append(_greedy_walk(tree, argmax[s:s + m]))
        else:
            out.append(sampled_accept(tree, probs[s:s + m], generator, without_replacement))
        s += m
    return out
