"""Tree attention over vLLM's paged KV cache (the tree rows of a verification step).

For a request with `prefix_len` tokens already cached, a tree step feeds 1 + n query rows: the
root (row 0) and the n nodes (row 1 + i), whose K/V vLLM has already written into the consecutive
slots of positions prefix_len .. prefix_len + n, so the request's seq_len is prefix_len + 1 + n.
Row t sees every prefix key plus the new keys j with tree_mask[t, j] (`DraftTree.ancestor_mask`).

CPU (`cpu_tree_attention`): one call of a small C kernel per layer (csrc/tree_attention.c, built
once per machine by `native.py`): it reads K/V straight from vLLM's packed cache and runs an online
softmax in fp32 over the key blocks of each tree request, like vLLM's vec kernel. Without a C
compiler (or with VLLM_SPEC_PLUGINS_NATIVE=0) a torch path computes the same: it reads K/V back from
the cache and runs all tree requests as one padded batch (fp32 GEMMs + softmax for the vec layouts;
one SDPA call otherwise, e.g. bf16/AMX). Either way the step's host arrays, indices and masks are
built once (`build_native_plan` / `build_tree_plan`, or memoized) and reused by every layer.

The CPU cache is *not* the plain
[num_blocks, num_kv_heads, block_size, head_size] layout its shape suggests:
`ops.cpu_attn_reshape_and_cache` packs every (block, kv head) region for the kernel's ISA
  * "vec" / "vec16" (fp32, or bf16/fp16 without AMX): K as [head_size, block_size] (column
    major), V as [block_size, head_size];
  * "amx" (bf16 on AMX CPUs): K as [block_size/16, head_size/2, 16 tokens, 2] (VNNI pairs),
    V as [head_size/16, block_size/2, 16 dims, 2 tokens];
  * other ISAs (neon, vsx, vxe, rvv): derived once by probing the op (`_probe_layout`).
So every reader/writer of the cache must know the ISA (`layer.isa`, or `attn_isa()`, which
repeats vLLM's choice). `read_kv_slots` / `copy_kv_slots` are the layout-aware slot helpers.

GPU (`triton_tree_attention`): vLLM's Triton `unified_attention` with `qq_bias`, on the Triton
backend's cache layout [num_blocks, block_size, num_kv_heads, head_size]. Its qq_bias is ONE
[rows, cols] additive bias shared by every sequence of the launch, indexed by the query row
within its sequence and the key position relative to the sequence's first query key
(`key_pos - context_len`, applied only where 0 <= that < cols, i.e. `qq_bias.stride(0)`), on top
of the causal mask. So trees of different shapes cannot share one launch: requests are grouped
by identical mask and each group is one launch (a static tree shape -> one launch per layer).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F

__all__ = [
    "attn_isa", "gather_kv", "read_kv_slots", "copy_kv_slots", "TreeAttentionPlan",
    "build_tree_plan", "NativeTreePlan", "build_native_plan", "native_supported", "cpu_tree_attention",
    "triton_tree_attention",
]

# ---------------------------------------------------------------------------------------------
# CPU cache layout
# ---------------------------------------------------------------------------------------------

def attn_isa(dtype: torch.dtype, block_size: int, head_size: int, kv_cache_dtype: str = "auto") -> str:
    """The ISA vLLM's CPU backend picks for these shapes (same helper the metadata builder uses;
    the builder passes the model dtype, which is the cache dtype for kv_cache_dtype 'auto')."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    return _get_attn_isa(dtype, block_size, head_size, kv_cache_dtype)


def _resolve_isa(isa: str | None, key_cache: torch.Tensor) -> str:
    if key_cache.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise NotImplementedError(f"tree attention supports fp32/bf16/fp16 KV caches, not {key_cache.dtype}")
    return isa if isa is not None else attn_isa(key_cache.dtype, key_cache.shape[2], key_cache.shape[3])


def _region_view(cache: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """View each (block, kv head) region of `cache` ([nb, Hkv, bs, D], regions contiguous) as
    `shape` (row-major)."""
    nb, hkv, bs, d = cache.shape
    if cache.stride(3) != 1 or cache.stride(2) != d:
        raise ValueError("KV cache regions must be contiguous [block_size, head_size] chunks "
                         f"(got strides {cache.stride()})")
    inner = [1]
    for s in reversed(shape[1:]):
        inner.insert(0, inner[0] * s)
    return cache.as_strided((nb, hkv, *shape), (cache.stride(0), cache.stride(1), *inner),
                            cache.storage_offset())


@functools.lru_cache(maxsize=None)
def _probe_layout(isa: str, dtype: torch.dtype, block_size: int, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_off, v_off): [block_size, head_size] int64 offsets of element (slot, dim) inside a
    (block, kv head) region, found by writing index digits with vLLM's own op (base 16, exact in
    every supported dtype)."""
    from vllm import _custom_ops as ops
    n = block_size * head_size
    ndig = max(1, math.ceil(math.log(max(block_size, head_size), 16)))
    slot = torch.arange(block_size)[:, None].expand(block_size, head_size)
    dim = torch.arange(head_size)[None, :].expand(block_size, head_size)
    kflat = torch.zeros(n, dtype=torch.long)
    vflat = torch.zeros(n, dtype=torch.long)
    for which, idx in ((0, slot), (1, dim)):
        for dgt in range(ndig):
            digit = (idx // 16 ** dgt) % 16
            kv = torch.zeros(1, 1, 2 * block_size, head_size, dtype=dtype)
            kc, vc = kv.chunk(2, dim=2)
            val = digit.to(dtype)[:, None, :].contiguous()           # [slots, 1 head, D]
            ops.cpu_attn_reshape_and_cache(val, val.clone(), kc, vc, torch.arange(block_size), isa)
            w = 16 ** dgt * (head_size if which == 0 else 1)            # flat id = slot * D + dim
            kflat += kc.reshape(-1).long() * w
            vflat += vc.reshape(-1).long() * w
    k_off = torch.empty(n, dtype=torch.long)
    v_off = torch.empty(n, dtype=torch.long)
    k_off[kflat] = torch.arange(n)
    v_off[vflat] = torch.arange(n)
    if not (torch.equal(kflat.sort().values, torch.arange(n)) and torch.equal(vflat.sort().values, torch.arange(n))):
        raise NotImplementedError(f"could not derive the CPU KV cache layout of isa {isa!r}")
    return k_off.view(block_size, head_size), v_off.view(block_size, head_size)


def _gather_one(cache: torch.Tensor, blk: torch.Tensor, off: torch.Tensor, layout: str, is_key: bool,
                isa_dtype: torch.dtype) -> torch.Tensor:
    """cache [nb, Hkv, bs, D] in `layout`; blk/off: same-shape int64 index tensors (...).
    Returns [..., Hkv, D] (a fresh tensor)."""
    nb, hkv, bs, d = cache.shape
    if layout == "plain" or (layout in ("vec", "vec16") and not is_key):
        return cache[blk, :, off]                                        # [..., Hkv, D]
    if layout in ("vec", "vec16"):                                       # K: [D, bs]
        return _region_view(cache, (d, bs))[blk, :, :, off]
    if layout == "amx":
        if bs % 16 or d % 32 or cache.element_size() != 2:
            raise NotImplementedError(f"amx layout needs a 16-bit cache, block_size % 16 == 0 and "
                                      f"head_size % 32 == 0 (got {cache.dtype}, {bs}, {d})")
        if is_key:   # [bs/16, D/2, 16 slots, 2 dims]
            r = _region_view(cache, (bs // 16, d // 2, 16, 2))[blk, :, off // 16, :, off % 16]
        else:        # [D/16, bs/2, 16 dims, 2 slots]
            r = _region_view(cache, (d // 16, bs // 2, 16, 2))[blk, :, :, off // 2, :, off % 2]
        return r.reshape(*blk.shape, hkv, d)
    k_off, v_off = _probe_layout(layout, isa_dtype, bs, d)
    flat = (k_off if is_key else v_off)[off]                             # [..., D]
    r = _region_view(cache, (bs * d,))[blk[..., None], :, flat]          # [..., D, Hkv]
    return r.transpose(-1, -2).contiguous()


def _gather(key_cache, value_cache, blk, off, isa):
    return (_gather_one(key_cache, blk, off, isa, True, key_cache.dtype),
            _gather_one(value_cache, blk, off, isa, False, key_cache.dtype))


def _gather_blocks(key_cache: torch.Tensor, value_cache: torch.Tensor, blocks: torch.Tensor,
                   layout: str) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Whole blocks of R requests. blocks: [R, nblk] int64 physical block ids.

    Returns (k, v, k_transposed): v [R, Hkv, nblk*bs, D] in slot order; k the same, or for the
    vec layouts (K stored [D, bs] per block) K^T [R, Hkv, D, nblk*bs], which is what the score
    GEMM wants and costs no transposition. One block gather (index_select) + one permuting copy
    per tensor."""
    nb, hkv, bs, d = key_cache.shape
    R, nblk = blocks.shape
    flat = blocks.reshape(-1)
    kr = _region_view(key_cache, (bs * d,)).index_select(0, flat)         # [R*nblk, Hkv, bs*D]
    vr = _region_view(value_cache, (bs * d,)).index_select(0, flat)
    S = nblk * bs
    if layout in ("vec", "vec16"):
        kt = kr.view(R, nblk, hkv, d, bs).permute(0, 2, 3, 1, 4).reshape(R, hkv, d, S)
        v = vr.view(R, nblk, hkv, bs, d).permute(0, 2, 1, 3, 4).reshape(R, hkv, S, d)
        return kt, v, True
    if layout == "plain":
        k = kr.view(R, nblk, hkv, bs, d).permute(0, 2, 1, 3, 4).reshape(R, hkv, S, d)
        v = vr.view(R, nblk, hkv, bs, d).permute(0, 2, 1, 3, 4).reshape(R, hkv, S, d)
        return k, v, False
    if layout == "amx":
        if bs % 16 or d % 32 or key_cache.element_size() != 2:
            raise NotImplementedError(f"amx layout needs a 16-bit cache, block_size % 16 == 0 and "
                                      f"head_size % 32 == 0 (got {key_cache.dtype}, {bs}, {d})")
        # K region [bs/16, D/2, 16 slots, 2 dims]: move the (2-dim) pairs as int32 words
        kw = kr.view(torch.int32).view(R, nblk, hkv, bs // 16, d // 2, 16)
        k = kw.permute(0, 2, 1, 3, 5, 4).reshape(R, hkv, S, d // 2).view(key_cache.dtype)
        # V region [D/16, bs/2, 16 dims, 2 slots]
        v = vr.view(R, nblk, hkv, d // 16, bs // 2, 16, 2).permute(0, 2, 1, 4, 6, 3, 5).reshape(R, hkv, S, d)
        return k, v, False
    k_off, v_off = _probe_layout(layout, key_cache.dtype, bs, d)
    k = kr.index_select(-1, k_off.flatten().to(kr.device)).view(R, nblk, hkv, bs, d)
    v = vr.index_select(-1, v_off.flatten().to(vr.device)).view(R, nblk, hkv, bs, d)
    return (k.permute(0, 2, 1, 3, 4).reshape(R, hkv, S, d),
            v.permute(0, 2, 1, 3, 4).reshape(R, hkv, S, d), False)


def gather_kv(key_cache: torch.Tensor, value_cache: torch.Tensor, block_table_row: torch.Tensor,
              seq_len: int, isa: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of positions 0..seq_len-1 of one request: [seq_len, num_kv_heads, head_size] each.

    key_cache/value_cache: the two [num_blocks, num_kv_heads, block_size, head_size] chunks of a
    CPU layer cache (see the module doc for their packed layouts). isa: the layer's `isa`
    (None -> `attn_isa` of the cache; "plain" -> unpacked [block, head, slot, dim], for caches
    written by plain indexing)."""
    isa = _resolve_isa(isa, key_cache)
    bs = key_cache.shape[2]
    seq_len = int(seq_len)
    nblk = (seq_len + bs - 1) // bs
    blocks = block_table_row[:nblk].to(key_cache.device).long()[None]
    k, v, kt = _gather_blocks(key_cache, value_cache, blocks, isa)
    k = k[0, :, :, :seq_len].permute(2, 0, 1) if kt else k[0, :, :seq_len].transpose(0, 1)
    return k.contiguous(), v[0, :, :seq_len].transpose(0, 1).contiguous()


def read_kv_slots(key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor,
                  isa: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V stored in the given flat slots (block * block_size + offset): [m, Hkv, D] each."""
    isa = _resolve_isa(isa, key_cache)
    bs = key_cache.shape[2]
    slots = slots.to(key_cache.device).long()
    return _gather(key_cache, value_cache, slots // bs, slots % bs, isa)


def copy_kv_slots(key_cache: torch.Tensor, value_cache: torch.Tensor, src_slots: torch.Tensor,
                  dst_slots: torch.Tensor, isa: str | None = None) -> None:
    """Copy K/V from src_slots to dst_slots (layout-aware; reads first, so overlaps are fine).
    Writes go through vLLM's own `cpu_attn_reshape_and_cache`, so any ISA layout works."""
    isa = _resolve_isa(isa, key_cache)
    k, v = read_kv_slots(key_cache, value_cache, src_slots, isa)
    if isa == "plain":
        bs = key_cache.shape[2]
        dst = dst_slots.to(key_cache.device).long()
        key_cache[dst // bs, :, dst % bs] = k
        value_cache[dst // bs, :, dst % bs] = v
        return
    from vllm import _custom_ops as ops
    ops.cpu_attn_reshape_and_cache(k, v, key_cache, value_cache, dst_slots.to(key_cache.device).long(), isa)


# ---------------------------------------------------------------------------------------------
# Step plan: everything that depends on the step's metadata only (shared by every layer)
# ---------------------------------------------------------------------------------------------

@dataclass(eq=False)
class TreeAttentionPlan:
    """Index tensors and the attention mask of one step, built once and reused for every layer.

    reqs: tree request indices (batch order); q_start/q_len/seq_len: their host values.
    For several requests the queries are padded to t_max rows and the keys to s_max positions;
    padding keys are zeroed and masked out; padding query rows attend to key 0 only (no NaN)
    and are dropped.
    """
    reqs: list[int]
    q_start: list[int]
    q_len: list[int]
    seq_len: list[int]
    block_size: int
    t_max: int
    s_max: int
    blocks: torch.Tensor           # [R, ceil(s_max / block_size)] physical blocks (padding
                                   # blocks repeat the request's last block)
    kv_pad: torch.Tensor | None    # [R, 1, s_max, 1] True at padding keys (zeroed: stale slots
                                   # could hold non-finite junk); None when there are none
    allowed: torch.Tensor          # [R, t_max, s_max] bool
    q_rows: torch.Tensor | None    # [R * t_max] query row of each padded row (None: R == 1)
    dst_rows: torch.Tensor | None  # [sum q_len] output rows, in request order
    src_rows: torch.Tensor | None  # [sum q_len] their positions in the flattened [R * t_max]
    _bias: dict = field(default_factory=dict)

    def bias(self, groups: int, dtype: torch.dtype) -> torch.Tensor:
        """[R, 1, groups * t_max, s_max] additive mask (0 / -inf) for the GQA-folded queries."""
        key = (groups, dtype)
        b = self._bias.get(key)
        if b is None:
            R = len(self.reqs)
            b = torch.zeros(self.allowed.shape, dtype=dtype, device=self.allowed.device)
            b.masked_fill_(~self.allowed, float("-inf"))
            b = b[:, None, None].expand(R, 1, groups, self.t_max, self.s_max)
            b = b.reshape(R, 1, groups * self.t_max, self.s_max)
            self._bias[key] = b
        return b


def _host_list(x: torch.Tensor | Sequence[int]) -> list[int]:
    return x.tolist() if isinstance(x, torch.Tensor) else [int(v) for v in x]


def _tree_rows(seq_lens, query_start_loc, tree_masks: Mapping[int, torch.Tensor]):
    """Tree requests in order with their query start, query length and sequence length; checks
    that each mask is square over the request's query rows and fits in its sequence."""
    qsl, sl = _host_list(query_start_loc), _host_list(seq_lens)
    reqs = sorted(int(r) for r in tree_masks)
    q_start, q_len, seq_len = [], [], []
    for r in reqs:
        m, T = tree_masks[r], qsl[r + 1] - qsl[r]
        if m.dim() != 2 or m.shape[0] != m.shape[1] or m.shape[0] != T:
            raise ValueError(f"request {r}: tree mask {tuple(m.shape)} but {T} query rows")
        if sl[r] < T:
            raise ValueError(f"request {r}: seq_len {sl[r]} < {T} query rows")
        q_start.append(qsl[r])
        q_len.append(T)
        seq_len.append(sl[r])
    return reqs, q_start, q_len, seq_len


def build_tree_plan(block_tables: torch.Tensor, seq_lens: torch.Tensor | Sequence[int],
                    query_start_loc: torch.Tensor | Sequence[int], tree_masks: Mapping[int, torch.Tensor],
                    block_size: int, device: torch.device | str | None = None) -> TreeAttentionPlan | None:
    """Plan for `cpu_tree_attention` (None when there are no tree requests). Host values of
    seq_lens / query_start_loc are read once here (pass host copies on GPU to avoid syncs)."""
    if not tree_masks:
        return None
    device = torch.device(device) if device is not None else block_tables.device
    reqs, q_start, q_len, seq_len = _tree_rows(seq_lens, query_start_loc, tree_masks)
    masks = [tree_masks[r].to(device=device, dtype=torch.bool) for r in reqs]
    R, t_max, s_max = len(reqs), max(q_len), max(seq_len)
    L = torch.tensor(seq_len, device=device)[:, None]
    P = L - torch.tensor(q_len, device=device)[:, None]                      # prefix lengths
    pos = torch.arange(s_max, device=device)[None, :]
    nblk = (s_max + block_size - 1) // block_size
    bt = block_tables[torch.tensor(reqs, device=block_tables.device), :nblk].to(device).long()
    last = (L - 1) // block_size                                              # [R, 1]
    blocks = bt.gather(1, torch.minimum(torch.arange(nblk, device=device)[None, :], last))
    kv_pad = (pos >= L)[:, None, :, None] if min(seq_len) < s_max else None
    # allowed[r, t, s] = s < prefix or tree_mask[t, s - prefix]
    tm = torch.zeros(R, t_max, t_max + 1, dtype=torch.bool, device=device)
    for i, m in enumerate(masks):
        tm[i, :q_len[i], :q_len[i]] = m
    rel = pos - P                                                             # [R, s_max]
    rel = torch.where((rel >= 0) & (rel < L - P), rel, t_max)
    allowed = tm.gather(2, rel[:, None, :].expand(R, t_max, s_max)) | (pos < P)[:, None, :]
    pad_rows = torch.arange(t_max, device=device)[None, :] >= torch.tensor(q_len, device=device)[:, None]
    allowed[:, :, 0] |= pad_rows
    q_rows = dst_rows = src_rows = None
    if R > 1:
        qr, dr, sr = [], [], []
        for i in range(R):
            qr += [q_start[i] + min(t, q_len[i] - 1) for t in range(t_max)]
            dr += range(q_start[i], q_start[i] + q_len[i])
            sr += range(i * t_max, i * t_max + q_len[i])
        q_rows = torch.tensor(qr, device=device)
        dst_rows = torch.tensor(dr, device=device)
        src_rows = torch.tensor(sr, device=device)
    return TreeAttentionPlan(reqs, q_start, q_len, seq_len, block_size, t_max, s_max, blocks, kv_pad,
                             allowed, q_rows, dst_rows, src_rows)


@dataclass(eq=False)
class NativeTreePlan:
    """Host arrays of one step for the C kernel, built once and reused by every layer:
    tree request indices, their q_start / q_len / seq_len (int32), the masks concatenated
    row-major (uint8), each mask's offset (int64) and each request's first row that is not
    causal (int32: the rows before it, root and the tree's leading path, are what vLLM's causal
    kernel already computed; the kernel skips them)."""
    arrays: tuple[torch.Tensor, ...]

    @property
    def nreq(self) -> int:
        return self.arrays[0].numel()


def build_native_plan(seq_lens: torch.Tensor | Sequence[int], query_start_loc: torch.Tensor | Sequence[int],
                      tree_masks: Mapping[int, torch.Tensor], skip_causal: bool = True) -> NativeTreePlan | None:
    """Plan for the C kernel (None when there are no tree requests); checks shapes as
    `build_tree_plan` does. skip_causal: leave each request's leading causal rows to vLLM's
    causal kernel (its output must already be in `out`, as in the forward pass)."""
    if not tree_masks:
        return None
    reqs, q_start, q_len, seq_len = _tree_rows(seq_lens, query_start_loc, tree_masks)
    masks = [tree_masks[r].to(device="cpu", dtype=torch.uint8).reshape(-1) for r in reqs]
    offs = [0]
    for T in q_len[:-1]:
        offs.append(offs[-1] + T * T)
    i32 = functools.partial(torch.tensor, dtype=torch.int32)
    row0 = [causal_rows(tree_masks[r]) if skip_causal else 0 for r in reqs]
    return NativeTreePlan((i32(reqs), i32(q_start), i32(q_len), i32(seq_len), torch.cat(masks),
                           torch.tensor(offs, dtype=torch.int64), i32(row0)))


def causal_rows(mask: torch.Tensor) -> int:
    """How many leading rows of a [T, T] tree mask are causal rows (row t sees exactly 0..t)."""
    T = mask.shape[0]
    same = (mask.to(torch.bool) == torch.ones(T, T, dtype=torch.bool).tril()).all(dim=1)
    return T if bool(same.all()) else int(same.to(torch.int8).argmin())


_NATIVE_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def native_supported(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether the C kernel can run this layer (and is built)."""
    from vllm_spec_plugins import native
    return (query.device.type == "cpu" and query.dtype in _NATIVE_DTYPES and key_cache.dtype == query.dtype
            and query.shape[-1] % 16 == 0 and native.library() is not None)


@functools.lru_cache(maxsize=None)
def _native_layout(isa: str, dtype: torch.dtype, block_size: int, head_size: int):
    """(layout code, k_off, v_off) for the C kernel: 0 for vec/vec16 (read directly), else 1 with
    int32 offset tables of element (slot, dim) inside a (block, kv head) region."""
    if isa in ("vec", "vec16"):
        return 0, None, None
    if isa == "plain":
        k_off = v_off = torch.arange(block_size * head_size).view(block_size, head_size)
    else:
        k_off, v_off = _probe_layout(isa, dtype, block_size, head_size)
    return 1, k_off.to(torch.int32).contiguous(), v_off.to(torch.int32).contiguous()


def prepare_native(plan: NativeTreePlan, query, key_cache, value_cache, block_tables, scale, out, isa):
    """The C kernel's call for one step, checked once: returns run(q, k, v, o), which takes the
    data pointers of a layer's query, key / value cache and output (same shapes, strides and
    dtypes as these) and runs the kernel. The forward pass calls it once per layer."""
    from vllm_spec_plugins import native
    N, H, D = query.shape
    _, Hkv, bs, _ = key_cache.shape
    o3 = out.view(out.shape[0], H, D)
    if query.stride(2) != 1 or o3.stride(2) != 1 or out.dtype != query.dtype:
        raise ValueError("the C tree-attention kernel needs query/out with contiguous head_size and "
                         "one dtype")
    _region_view(key_cache, (bs * D,))                        # checks the region layout
    if value_cache.stride()[:2] != key_cache.stride()[:2]:
        raise ValueError("key and value caches must share strides")
    layout, k_off, v_off = _native_layout(isa, key_cache.dtype, bs, D)
    bt = block_tables
    if bt.dtype != torch.int32 or bt.stride(1) != 1:
        bt = bt.to(torch.int32).contiguous()
    fn = native.library()
    q_s, c_s, o_s = (query.stride(0), query.stride(1)), (key_cache.stride(0), key_cache.stride(1)), \
        (o3.stride(0), o3.stride(1))
    rest = (bt.data_ptr(), bt.stride(0), plan.nreq, *(a.data_ptr() for a in plan.arrays), H, Hkv, D, bs,
            scale, _NATIVE_DTYPES[query.dtype], layout,
            k_off.data_ptr() if k_off is not None else None, v_off.data_ptr() if v_off is not None else None)

    def run(q: int, k: int, v: int, o: int) -> None:
        if fn(q, *q_s, k, v, *c_s, o, *o_s, *rest) != 0:
            raise RuntimeError("C tree-attention kernel refused its inputs")
    run.arrays = (plan, bt, k_off, v_off)                     # keeps the pointers above valid
    return run


def _native_tree_attention(plan: NativeTreePlan, query, key_cache, value_cache, block_tables, scale, out, isa):
    prepare_native(plan, query, key_cache, value_cache, block_tables, scale, out, isa)(
        query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), out.data_ptr())
    return out


# One-entry memo so callers that pass no plan still build it once per step, not once per layer.
# The tree_masks dict is held (so its id cannot be reused); host metadata, the masks' identity
# (data_ptr) and the block table rows are compared on every hit.
_memo: dict = {}


def _masks_key(tree_masks: Mapping[int, torch.Tensor]) -> tuple:
    # (no m._version: masks built under torch.inference_mode() have none; masks are never mutated)
    return tuple((r, tuple(m.shape), m.data_ptr()) for r, m in tree_masks.items())


def _memo_plan(block_tables, seq_lens, query_start_loc, tree_masks, block_size, device, native=False):
    sl, qsl = _host_list(seq_lens), _host_list(query_start_loc)
    key = (id(tree_masks), tuple(sl), tuple(qsl), block_size, str(device), _masks_key(tree_masks))
    if native:
        hit = _memo.get("native")
        if hit is not None and hit[0] == key and hit[1] is tree_masks:
            return hit[2]
        plan = build_native_plan(sl, qsl, tree_masks)
        _memo["native"] = (key, tree_masks, plan)
        return plan
    hit = _memo.get("plan")
    if hit is not None and hit[0] == key and hit[1] is tree_masks:
        plan, bt_rows = hit[2], hit[3]
        cur = block_tables[plan.reqs, :bt_rows.shape[1]]
        if torch.equal(cur, bt_rows):
            return plan
    plan = build_tree_plan(block_tables, sl, qsl, tree_masks, block_size, device)
    if plan is not None:
        nblk = (plan.s_max + block_size - 1) // block_size
        _memo["plan"] = (key, tree_masks, plan, block_tables[plan.reqs, :nblk].clone())
    return plan


# ---------------------------------------------------------------------------------------------
# CPU path
# ---------------------------------------------------------------------------------------------

def cpu_tree_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                       tree_masks: Mapping[int, torch.Tensor], scale: float, out: torch.Tensor, *,
                       isa: str | None = None, plan: TreeAttentionPlan | NativeTreePlan | None = None,
                       native: bool | None = None) -> torch.Tensor:
    """Masked attention of the tree requests' rows, written into `out` (other rows untouched).

    query: [num_tokens, H, D]; key_cache/value_cache: [num_blocks, Hkv, block_size, D] CPU cache
    chunks (vLLM's packed layout for `isa`; None -> `attn_isa`, the backend's own choice);
    block_tables [num_reqs, max_blocks]; seq_lens [num_reqs] (keys incl. this step's rows);
    query_start_loc [num_reqs + 1]; tree_masks: request index -> [1+n, 1+n] bool;
    out: [num_tokens, H, D] or [num_tokens, H * D]. GQA: head h uses kv head h // (H // Hkv).
    plan: `build_native_plan(...)` or `build_tree_plan(...)` of this step (else built and memoized).
    native: True forces the C kernel, False the torch path; None picks by the plan, else the
    kernel wherever `native_supported`.

    C kernel: per request and kv head, an online softmax over the cache blocks (module doc). With
    a plan built by default (`build_native_plan(skip_causal=True)`) it leaves each request's
    leading causal rows as they are in `out`: in the forward pass vLLM's causal kernel wrote them.
    Torch path: all tree requests run as one padded batch. vec/vec16 caches (K stored transposed): two
    GEMMs + softmax in fp32, like vLLM's vec kernel. Other layouts (amx): one SDPA call in the
    query dtype (fp32 accumulation inside), like vLLM's AMX kernel.
    """
    if not tree_masks:
        return out
    N, H, D = query.shape
    _, Hkv, bs, Dk = key_cache.shape
    if Dk != D or H % Hkv:
        raise ValueError(f"query [*, {H}, {D}] does not fit KV cache [*, {Hkv}, *, {Dk}]")
    isa = _resolve_isa(isa, key_cache)
    if native is None:
        native = isinstance(plan, NativeTreePlan) or (plan is None and native_supported(query, key_cache))
    if native:
        if plan is None:
            plan = _memo_plan(block_tables, seq_lens, query_start_loc, tree_masks, bs, query.device, native=True)
        elif not isinstance(plan, NativeTreePlan):
            raise ValueError("native=True needs a NativeTreePlan (build_native_plan)")
        return _native_tree_attention(plan, query, key_cache, value_cache, block_tables, scale, out, isa)
    if plan is None:
        plan = _memo_plan(block_tables, seq_lens, query_start_loc, tree_masks, bs, query.device)
    elif not isinstance(plan, TreeAttentionPlan):
        raise ValueError("the torch path needs a TreeAttentionPlan (build_tree_plan)")
    elif plan.block_size != bs:
        raise ValueError(f"plan built for block_size {plan.block_size}, cache has {bs}")
    g, R, Tm, Sm = H // Hkv, len(plan.reqs), plan.t_max, plan.s_max
    k, v, kt = _gather_blocks(key_cache, value_cache, plan.blocks, isa)
    k = k[..., :Sm] if kt else k[:, :, :Sm]            # K^T [R, Hkv, D, Sm] or K [R, Hkv, Sm, D]
    v = v[:, :, :Sm]
    if plan.kv_pad is not None:                        # zero stale slots (could be non-finite)
        k.masked_fill_(plan.kv_pad.transpose(-1, -2) if kt else plan.kv_pad, 0)
        v.masked_fill_(plan.kv_pad, 0)
    if R == 1:
        q = query[plan.q_start[0]:plan.q_start[0] + Tm]                       # [Tm, H, D]
    else:
        q = query.index_select(0, plan.q_rows)                                # [R*Tm, H, D]
    # Fold the g query heads of a kv head into the query axis: [R, Hkv, g*Tm, D], rows (g, t).
    q = q.view(R, Tm, Hkv, g, D).permute(0, 2, 3, 1, 4).reshape(R, Hkv, g * Tm, D)
    if kt:
        # vec layouts: vLLM's vec kernel computes in fp32 with q pre-scaled; so do we, as GEMMs
        # on K^T straight from the cache layout.
        q = q.to(torch.float32) * scale
        s = torch.matmul(q, k.to(torch.float32)).add_(plan.bias(g, torch.float32))
        o = torch.matmul(torch.softmax(s, dim=-1), v.to(torch.float32)).to(query.dtype)
    else:
        o = F.scaled_dot_product_attention(q, k.to(query.dtype), v.to(query.dtype),
                                           attn_mask=plan.bias(g, query.dtype), scale=scale)
    o = o.view(R, Hkv, g, Tm, D).permute(0, 3, 1, 2, 4).reshape(R * Tm, H, D)
    o3 = out.view(out.shape[0], H, D)
    if R == 1:
        o3[plan.q_start[0]:plan.q_start[0] + Tm] = o
    else:
        o3.index_copy_(0, plan.dst_rows, o.index_select(0, plan.src_rows).to(out.dtype))
    return out


# ---------------------------------------------------------------------------------------------
# GPU path: vLLM's Triton unified_attention + qq_bias
# ---------------------------------------------------------------------------------------------

def tree_qq_bias(mask: torch.Tensor, block_q_pad: int = 16, dtype: torch.dtype = torch.float32,
                 device=None) -> torch.Tensor:
    """qq_bias for one tree shape: [T + block_q_pad, T], 0 where mask is True, -inf elsewhere.

    Column count = stride(0) is the width unified_attention masks with; the extra zero rows
    cover the kernel's padded query rows (query_pos up to a multiple of BLOCK_Q <= 16, which it
    reads without a row bound)."""
    T = mask.shape[0]
    b = torch.zeros(T + block_q_pad, T, dtype=dtype, device=device)
    b[:T].masked_fill_(~mask.to(device=b.device, dtype=torch.bool), float("-inf"))
    return b


@dataclass(eq=False)
class _TritonGroup:
    reqs: list[int]
    q_len: int
    max_seq_len: int
    ridx: torch.Tensor              # [g] request indices (device)
    rows: torch.Tensor | None       # [g * q_len] query rows, None when the requests are adjacent
    span: tuple[int, int]           # row range when adjacent
    cu_seqlens_q: torch.Tensor      # [g + 1] int32
    qq_bias: torch.Tensor           # tree_qq_bias of the group's mask


def _triton_groups(tree_masks, qsl: list[int], sl: list[int], device) -> list[_TritonGroup]:
    by_mask: dict[tuple, list[int]] = {}
    mask_of: dict[tuple, torch.Tensor] = {}
    for r in sorted(int(r) for r in tree_masks):
        m = tree_masks[r].to(torch.bool)
        T = qsl[r + 1] - qsl[r]
        if m.shape != (T, T):
            raise ValueError(f"request {r}: tree mask {tuple(m.shape)} but {T} query rows")
        if sl[r] < T:
            raise ValueError(f"request {r}: seq_len {sl[r]} < {T} query rows")
        key = (T, m.cpu().numpy().tobytes())
        by_mask.setdefault(key, []).append(r)
        mask_of.setdefault(key, m)
    groups = []
    for key, reqs in by_mask.items():
        T, n = key[0], len(reqs)
        adjacent = reqs == list(range(reqs[0], reqs[0] + n))
        rows = None if adjacent else torch.tensor([qsl[r] + t for r in reqs for t in range(T)], device=device)
        groups.append(_TritonGroup(
            reqs, T, max(sl[r] for r in reqs), torch.tensor(reqs, device=device), rows,
            (qsl[reqs[0]], qsl[reqs[-1] + 1]),
            torch.arange(0, (n + 1) * T, T, dtype=torch.int32, device=device),
            tree_qq_bias(mask_of[key], device=device)))
    return groups


_triton_memo: dict = {}


def triton_tree_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                          tree_masks: Mapping[int, torch.Tensor], scale: float, out: torch.Tensor, *,
                          query_start_loc_cpu: torch.Tensor | Sequence[int] | None = None,
                          seq_lens_cpu: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
    """`cpu_tree_attention` for the Triton backend: key_cache/value_cache are
    [num_blocks, block_size, Hkv, D] (vLLM's triton_attn cache unbound on dim 1).

    Requests are grouped by identical tree mask (qq_bias is shared by a whole launch, see the
    module doc); each group is one `unified_attention` launch with causal=True + the group's
    qq_bias. A group whose requests are adjacent in the batch runs in place on slices of
    query/out; otherwise its rows are gathered and scattered back. The host-side grouping, index
    tensors and biases are memoized for the step (same tree_masks dict and host metadata), block
    tables and seq_lens are read on the device on every call. Pass host copies of
    query_start_loc / seq_lens to avoid device syncs.
    """
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention
    if not tree_masks:
        return out
    N, H, D = query.shape
    qsl = _host_list(query_start_loc_cpu if query_start_loc_cpu is not None else query_start_loc)
    sl = _host_list(seq_lens_cpu if seq_lens_cpu is not None else seq_lens)
    dev = query.device
    key = (id(tree_masks), tuple(qsl), tuple(sl), str(dev), _masks_key(tree_masks))
    hit = _triton_memo.get("groups")
    if hit is not None and hit[0] == key and hit[1] is tree_masks:
        groups = hit[2]
    else:
        groups = _triton_groups(tree_masks, qsl, sl, dev)
        _triton_memo["groups"] = (key, tree_masks, groups)
    o3 = out.view(out.shape[0], H, D)
    ones = torch.ones(1, dtype=torch.float32, device=dev)
    for grp in groups:
        if grp.rows is None:
            a, b = grp.span
            q_g, out_g = query[a:b], o3[a:b]
        else:
            q_g = query.index_select(0, grp.rows)
            out_g = torch.empty_like(q_g)
        unified_attention(
            q=q_g, k=key_cache, v=value_cache, out=out_g, cu_seqlens_q=grp.cu_seqlens_q,
            max_seqlen_q=grp.q_len, seqused_k=seq_lens[grp.ridx].to(torch.int32),
            max_seqlen_k=grp.max_seq_len, softmax_scale=scale, causal=True, window_size=(-1, -1),
            block_table=block_tables[grp.ridx], softcap=0, q_descale=None, k_descale=ones,
            v_descale=ones, qq_bias=grp.qq_bias)
        if grp.rows is not None:
            o3.index_copy_(0, grp.rows, out_g.to(out.dtype))
    return out
