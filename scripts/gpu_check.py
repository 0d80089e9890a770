#!/usr/bin/env python
"""The project's one prepared GPU run: the Triton tree-attention kernel check and a
verification-cost curve, written as JSON into OUT_DIR.

    python scripts/gpu_check.py OUT_DIR                      # on a CUDA GPU (--budget-s 400 caps it)
    python scripts/gpu_check.py OUT_DIR --quick --interpret  # CPU rehearsal (Triton's interpreter)

Part 1, kernel (OUT_DIR/kernel_check.json): vLLM's Triton `unified_attention` with `qq_bias`,
called through the plugin's own `vllm_spec_plugins.tree_attention.triton_tree_attention`, against
a float32 reference (plain softmax attention over the K/V gathered from the paged cache, with the
tree's ancestor mask) on random batches: trees of 1..64 rows (several shapes, shared and
distinct, adjacent and not), chains, plain decode rows and causal multi-token rows; block sizes
16 and 32 with shuffled block tables; bf16 and fp16; three head layouts (GQA 4, 7 and 1). Every
case runs twice: the plugin alone on a NaN-poisoned output (non-tree rows must stay NaN), and
the forward pass's composition (vLLM's causal call over the whole batch, then the plugin over
the tree rows) checked on every row. Then timings (CUDA events, medians): the plugin's tree call
vs the same unified_attention call with the causal mask only (no qq_bias), per context, batch and
tree size.

Part 2, curve (OUT_DIR/cost_curve.json): one decode step of a transformers LlamaForCausalLM
with Llama-3-8B's shapes and random bf16 weights (built on the GPU), for 1..64 query tokens per
request, batch 1..64, context 512/2048/8192, chain (causal) vs tree (a random tree shape per cell),
with two attention paths: 'triton' (every layer runs the bundled vLLM unified_attention over a
paged cache, the tree as qq_bias: the plugin's GPU path) and 'sdpa' (transformers' SDPA with a
4-D additive mask). Each path first passes a mask sanity check (a tree row equals a chain step
over its path). CUDA-graph replays where capture works (else eager, recorded per cell). A time
budget (--budget-s) guards the whole run: cells past it are recorded as skipped (batches 1 and 8
of both paths come first); cells that do not fit in memory are recorded as such.

Part 0, compile (OUT_DIR/compile_check.json, only where there is no GPU): every kernel variant
of part 1 compiled for sm_90 with the installed Triton (stand-in driver, Triton's own ptxas),
with registers / local memory read off the cubins.

vLLM itself is not needed: the kernel comes from the bundle that scripts/gpu_bundle.py builds
(.gpu_bundle, carried to the GPU machine). docs/gpu.md has the exact device call.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import importlib.util
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_BUNDLE = REPO / ".gpu_bundle"
SCHEMA = 1

# Tolerances of the kernel check (output in the case's dtype vs the float32 reference):
# rel = ||out - ref|| / ||ref|| over the checked rows, abs = max |out - ref|. NaN never passes.
TOLERANCE = {"bfloat16": {"rel": 2e-2, "abs": 6e-2},
             "float16": {"rel": 5e-3, "abs": 1e-2},
             "float32": {"rel": 1e-4, "abs": 1e-3}}

LLAMA3_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 intermediate_size=14336, vocab_size=128256, max_position_embeddings=16384,
                 rope_theta=500000.0)
TINY = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=512, vocab_size=1024, max_position_embeddings=4096, rope_theta=10000.0)


# ---------------------------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------------------------

class Budget:
    def __init__(self, total_s: float):
        self.t0 = time.monotonic()
        self.total = float(total_s)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.total - self.elapsed()


def log(msg: str) -> None:
    print(msg, flush=True)


def progress(total: int, desc: str):
    """tqdm if present (ASCII, sparse updates: the device tool returns only the output's tail)."""
    try:
        from tqdm import tqdm
        return tqdm(total=total, desc=desc, ascii=True, mininterval=10.0, file=sys.stdout)
    except Exception:                                            # pragma: no cover
        class _P:
            n = 0

            def update(self, k=1):
                self.n += k
                if self.n % 20 == 0 or self.n == total:
                    log(f"{desc}: {self.n}/{total}")

            def set_postfix_str(self, s):
                pass

            def close(self):
                pass
        return _P()


def write_json(path: Path, obj) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def git_sha(bundle: Path | None) -> dict:
    out = {"sha": None, "dirty": None, "source": None}
    try:
        p = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if p.returncode == 0 and p.stdout.strip():
            out["sha"], out["source"] = p.stdout.strip(), "git"
            d = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
            out["dirty"] = bool(d.stdout.strip())
            return out
    except Exception:
        pass
    if bundle is not None and (bundle / "MANIFEST.json").exists():     # the GPU machine has no .git
        try:
            out["sha"] = json.loads((bundle / "MANIFEST.json").read_text()).get("git_sha")
            out["source"] = "bundle MANIFEST.json (the commit checked out when the bundle was built)"
        except Exception:
            pass
    return out


def environment(torch, bundle: Path | None, args) -> dict:
    env = {
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv,
        "python": platform.python_version(),
        "host": platform.node(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "git": git_sha(bundle),
        "quick": bool(args.quick),
        "interpret": bool(args.interpret),
    }
    for mod in ("triton", "transformers", "numpy"):
        try:
            env[mod] = importlib.import_module(mod).__version__
        except Exception as e:                                   # noqa: BLE001
            env[mod] = f"unavailable: {type(e).__name__}"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env["device"] = {"name": p.name, "capability": f"{p.major}.{p.minor}",
                         "memory_gib": round(p.total_memory / 2 ** 30, 1),
                         "multiprocessors": p.multi_processor_count}
        try:
            env["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem,power.limit",
                 "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
        except Exception:
            pass
    else:
        env["device"] = {"name": "cpu", "threads": torch.get_num_threads()}
    return env


def timer(torch, device):
    """median_ms(fn, reps, warmup): CUDA events on a GPU (one pair per repeat), perf_counter on CPU."""
    cuda = device.type == "cuda"

    def median_ms(fn, reps: int, warmup: int = 2) -> dict:
        for _ in range(warmup):
            fn()
        if cuda:
            torch.cuda.synchronize()
            ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
            for a, b in ev:
                a.record()
                fn()
                b.record()
            torch.cuda.synchronize()
            ts = [a.elapsed_time(b) for a, b in ev]
        else:
            ts = []
            for _ in range(reps):
                t = time.perf_counter()
                fn()
                ts.append((time.perf_counter() - t) * 1e3)
        return {"ms": statistics.median(ts), "min_ms": min(ts), "max_ms": max(ts), "reps": reps}
    return median_ms


# ---------------------------------------------------------------------------------------------
# trees
# ---------------------------------------------------------------------------------------------

def draft_tree_cls():
    try:
        from vllm_spec_plugins.scorers import DraftTree
    except ImportError:                      # not installed (GPU machine): the repo's scorers/ folder
        if str(REPO) not in sys.path:
            sys.path.insert(0, str(REPO))
        from scorers.tree import DraftTree
    return DraftTree


def random_parents(rng: random.Random, n: int, style: str) -> list[int]:
    if style == "wide":
        return [-1] * n
    if style == "chain":
        return list(range(-1, n - 1))
    if style == "deep":
        return [i - 1 if rng.random() < 0.75 else rng.randint(-1, i - 1) for i in range(n)]
    if style == "kary":
        k = rng.randint(2, 4)
        return [i // k - 1 for i in range(n)]
    return [rng.randint(-1, i - 1) for i in range(n)]


def random_tree_mask(rng: random.Random, DraftTree, rows: int, style: str | None = None):
    """[rows, rows] ancestor mask (root + rows-1 nodes) and the rows' depths."""
    n = rows - 1
    style = style or rng.choice(["random", "deep", "wide", "kary"])
    t = DraftTree([0] * n, random_parents(rng, n, style))
    return t.ancestor_mask(), [0] + t.depths, style


# ---------------------------------------------------------------------------------------------
# part 1: the kernel
# ---------------------------------------------------------------------------------------------

INTERPRETER_QQ_NOTE = ("vLLM's load_qq_bias_tile uses `a and b` on tensors: compiled Triton lowers it to "
                       "logical_and, Triton's interpreter evaluates Python truthiness and masks the wrong keys. "
                       "Under --interpret the helper is replaced by the same code with `&` (tests/"
                       "test_tree_attention.py does the same); compiled runs use vLLM's helper unchanged.")


INTERPRETER_QQ_HELPER = '''import triton
import triton.language as tl


@triton.jit
def load_qq_bias_tile(qq_bias_row_ptrs, seq_offset, context_len, qq_bias_stride_0):
    key_rel_pos = seq_offset - context_len
    is_query_key = (key_rel_pos >= 0) & (key_rel_pos < qq_bias_stride_0)
    return tl.load(qq_bias_row_ptrs + key_rel_pos[None, :], mask=is_query_key[None, :], other=0.0)
'''


_KERNEL: dict = {}


def load_kernel(args):
    if "k" not in _KERNEL:
        _KERNEL["k"] = _load_kernel(args)
    return _KERNEL["k"]


def _load_kernel(args):
    """Import vLLM's unified_attention (from the bundle unless --vllm installed) and the plugin's
    tree_attention module; returns (tua module, plugin module, info dict)."""
    info = {}
    if args.vllm == "bundle":
        bundle = Path(args.bundle).resolve()
        if not (bundle / "vllm").is_dir():
            if importlib.util.find_spec("vllm") is None:
                raise SystemExit(f"no kernel bundle at {bundle} and no vLLM installed: run "
                                 "`python scripts/gpu_bundle.py` where vLLM is installed and carry .gpu_bundle")
            sys.path.insert(0, str(REPO / "scripts"))
            import gpu_bundle
            log(f"no bundle at {bundle}: building it from the installed vLLM")
            gpu_bundle.build(bundle)
        for m in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
            del sys.modules[m]
        sys.path.insert(0, str(bundle))
        info["bundle"] = str(bundle)
        try:
            info["bundle_manifest"] = json.loads((bundle / "MANIFEST.json").read_text())
        except Exception:
            pass
    import triton  # noqa: F401 (after TRITON_INTERPRET)
    import vllm.v1.attention.ops.triton_unified_attention as tua
    info["kernel_file"] = tua.__file__
    if args.vllm == "bundle" and not str(Path(tua.__file__).resolve()).startswith(str(Path(args.bundle).resolve())):
        raise SystemExit(f"unified_attention came from {tua.__file__}, not the bundle")
    info["interpreter_qq_helper_patched"] = False
    if args.interpret:
        # @triton.jit needs the function's source file and `tl` among its globals: write it out
        import tempfile
        src = Path(tempfile.mkdtemp(prefix="gpu_check_")) / "interp_qq_helper.py"
        src.write_text(INTERPRETER_QQ_HELPER)
        spec = importlib.util.spec_from_file_location("_gpu_check_interp_qq_helper", src)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        load_qq_bias_tile = mod.load_qq_bias_tile
        tua.load_qq_bias_tile = load_qq_bias_tile
        info["interpreter_qq_helper_patched"] = True
        info["interpreter_note"] = INTERPRETER_QQ_NOTE
    # The plugin's own GPU path. Its package __init__ imports nothing from vLLM; should that change,
    # load tree_attention.py alone (it needs only torch at import time).
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    try:
        ta = importlib.import_module("vllm_spec_plugins.tree_attention")
        info["plugin_import"] = "vllm_spec_plugins.tree_attention"
    except Exception as e:                                         # noqa: BLE001
        path = REPO / "vllm_spec_plugins" / "tree_attention.py"
        spec = importlib.util.spec_from_file_location("_plugin_tree_attention", path)
        ta = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(ta)
        info["plugin_import"] = f"by file path ({type(e).__name__}: {e})"
    info["plugin_file"] = ta.__file__
    return tua, ta, info


def kernel_cases(args) -> list[dict]:
    if args.quick:
        dts = args.interp_dtypes
        heads = [(4, 2, 32), (6, 2, 32)]
        out = []
        for i, bs in enumerate((16, 32)):
            for j, dt in enumerate(dts):
                out.append(dict(dtype=dt, block_size=bs, heads=heads[(i + j) % 2], n_req=8, max_rows=10,
                                prefixes=(0, 40), seed=100 * i + j))
        return out
    out = []
    for seed in (0, 1):
        for dt in ("bfloat16", "float16"):
            for bs in (16, 32):
                out.append(dict(dtype=dt, block_size=bs, heads=(32, 8, 128), n_req=14, max_rows=64,
                                prefixes=(0, 4096), seed=seed * 10 + bs + (dt == "float16")))
    for dt, bs, heads, seed in (("bfloat16", 16, (28, 4, 128), 7), ("float16", 32, (28, 4, 128), 8),
                                ("bfloat16", 32, (16, 16, 64), 9), ("float16", 16, (16, 16, 64), 11)):
        out.append(dict(dtype=dt, block_size=bs, heads=heads, n_req=12, max_rows=64, prefixes=(0, 3000), seed=seed))
    return out


def build_batch(rng: random.Random, DraftTree, case: dict) -> list[dict]:
    """Requests of one batch: kind in tree | chain (a chain as a tree mask) | decode (1 row, not in
    tree_masks) | causal (2..8 rows, not in tree_masks); trees of 1..max_rows rows. Some trees
    repeat (a group of 2-3 requests, adjacent or not)."""
    n, maxr = case["n_req"], case["max_rows"]
    lo, hi = case["prefixes"]

    def prefix():
        u = rng.random()                    # short prefixes keep each tree key's weight visible
        if u < 0.35:
            return rng.randint(0, min(hi, 48))
        if u < 0.7:
            return rng.randint(lo, min(hi, 600))
        return rng.randint(lo, hi)

    reqs: list[dict] = []
    shared = None
    # guaranteed: the largest tree, a 1-row tree, a chain, a decode row, a causal multi-row
    # request and (n >= 7) two requests sharing one tree
    reqs.append(dict(kind="tree", rows=maxr))
    reqs.append(dict(kind="tree", rows=1))
    reqs.append(dict(kind="chain", rows=rng.randint(2, min(maxr, 16))))
    reqs.append(dict(kind="decode", rows=1))
    reqs.append(dict(kind="causal", rows=rng.randint(2, 8)))
    if n >= 7:
        m, d, st = random_tree_mask(rng, DraftTree, rng.randint(2, maxr))
        shared = dict(kind="tree", rows=m.shape[0], mask=m, depths=d, style=st, shared=True)
        reqs += [dict(shared), dict(shared)]
    while len(reqs) < n:
        k = rng.choices(["tree", "shared", "decode", "causal", "chain"], [4, 2, 2, 1, 1])[0]
        if k == "tree":
            reqs.append(dict(kind="tree", rows=rng.randint(2, maxr)))
        elif k == "shared":
            if shared is None:
                m, d, st = random_tree_mask(rng, DraftTree, rng.randint(2, maxr))
                shared = dict(kind="tree", rows=m.shape[0], mask=m, depths=d, style=st, shared=True)
            for _ in range(rng.randint(1, 2)):
                if len(reqs) < n:
                    reqs.append(dict(shared))
        elif k == "decode":
            reqs.append(dict(kind="decode", rows=1))
        elif k == "causal":
            reqs.append(dict(kind="causal", rows=rng.randint(2, 8)))
        else:
            reqs.append(dict(kind="chain", rows=rng.randint(2, min(maxr, 16))))
    rng.shuffle(reqs)
    for r in reqs:
        r["prefix"] = prefix()
        if r["kind"] == "tree" and "mask" not in r:
            r["mask"], r["depths"], r["style"] = random_tree_mask(rng, DraftTree, r["rows"])
        elif r["kind"] == "chain":
            r["mask"], r["depths"], r["style"] = random_tree_mask(rng, DraftTree, r["rows"], "chain")
    return reqs


def paged_layout(torch, rng: random.Random, reqs, bs: int, Hkv: int, D: int, dtype, device, gen):
    """Random paged K/V: block 0 is the null block (NaN, as are unreferenced spare blocks); each
    request's blocks are a random permutation slice; stale slots past a sequence's end hold
    large finite junk. Returns (kc, vc, block_table int32 [R, width], seq_lens list)."""
    seq = [r["prefix"] + r["rows"] for r in reqs]
    nblk = [(s + bs - 1) // bs for s in seq]
    spare = 3
    nb = 1 + sum(nblk) + spare
    perm = list(range(1, nb))
    rng.shuffle(perm)
    # wide enough for any tile the kernel may touch past the end (tile <= 64 positions)
    width = max(nblk) + 64 // bs + 1
    bt = torch.zeros(len(reqs), width, dtype=torch.int32)
    used = 0
    for i, k in enumerate(nblk):
        bt[i, :k] = torch.tensor(perm[used:used + k], dtype=torch.int32)
        used += k
    kc = torch.randn(nb, bs, Hkv, D, generator=gen, device=device, dtype=torch.float32).to(dtype)
    vc = torch.randn(nb, bs, Hkv, D, generator=gen, device=device, dtype=torch.float32).to(dtype)
    for i, s in enumerate(seq):                               # stale slots: finite junk
        last = int(bt[i, nblk[i] - 1])
        kc[last, s - (nblk[i] - 1) * bs:] = 100.0
        vc[last, s - (nblk[i] - 1) * bs:] = -100.0
    nan_blocks = torch.tensor([0] + perm[used:], device=device)
    kc[nan_blocks] = float("nan")
    vc[nan_blocks] = float("nan")
    return kc, vc, bt.to(device), seq


def reference(torch, q, kc, vc, bt, reqs, seq, qsl, scale, masks_for_ref):
    """float32 attention per request over K/V gathered from the paged cache: the prefix is
    visible to every row, the request's own rows by its mask (tree/chain: the ancestor mask,
    decode/causal: causal)."""
    N, H, D = q.shape
    Hkv = kc.shape[2]
    bs = kc.shape[1]
    out = torch.empty(N, H, D, dtype=torch.float32, device=q.device)
    for i, r in enumerate(reqs):
        T, P, S = r["rows"], r["prefix"], seq[i]
        pos = torch.arange(S, device=q.device)
        blk = bt[i].long()[pos // bs]
        k = kc[blk, pos % bs].float().repeat_interleave(H // Hkv, dim=1)       # [S, H, D]
        v = vc[blk, pos % bs].float().repeat_interleave(H // Hkv, dim=1)
        m = masks_for_ref[i].to(q.device)
        allowed = torch.cat([torch.ones(T, P, dtype=torch.bool, device=q.device), m], dim=1)
        qi = q[qsl[i]:qsl[i + 1]].float()
        s = torch.einsum("thd,khd->htk", qi, k) * scale
        s = s.masked_fill(~allowed, float("-inf"))
        out[qsl[i]:qsl[i + 1]] = torch.einsum("htk,khd->thd", s.softmax(-1), v)
    return out


def run_kernel_case(torch, tua, ta, case: dict, device, DraftTree, fault: str) -> dict:
    rng = random.Random(case["seed"])
    gen = torch.Generator(device=device).manual_seed(case["seed"])
    dtype = getattr(torch, case["dtype"])
    H, Hkv, D = case["heads"]
    bs = case["block_size"]
    scale = D ** -0.5
    reqs = build_batch(rng, DraftTree, case)
    kc, vc, bt, seq = paged_layout(torch, rng, reqs, bs, Hkv, D, dtype, device, gen)
    qsl = [0]
    for r in reqs:
        qsl.append(qsl[-1] + r["rows"])
    N = qsl[-1]
    q = torch.randn(N, H, D, generator=gen, device=device).to(dtype)
    seq_t = torch.tensor(seq, dtype=torch.int32, device=device)
    qsl_t = torch.tensor(qsl, dtype=torch.int32, device=device)
    tree_masks, ref_masks, causal_masks = {}, [], []
    for i, r in enumerate(reqs):
        causal = torch.ones(r["rows"], r["rows"], dtype=torch.bool).tril()
        causal_masks.append(causal)
        if r["kind"] in ("tree", "chain"):
            m = r["mask"]
            ref_masks.append(m)
            km = m
            if fault == "mask" and r["rows"] >= 2:
                km = m.t().contiguous()          # deliberately wrong: the check must report it
            tree_masks[i] = km.to(device)
        else:
            ref_masks.append(causal)
    tree_rows = torch.zeros(N, dtype=torch.bool)
    for i in tree_masks:
        tree_rows[qsl[i]:qsl[i + 1]] = True
    tree_rows = tree_rows.to(device)

    ref = reference(torch, q, kc, vc, bt, reqs, seq, qsl, scale, ref_masks)
    ref_causal = reference(torch, q, kc, vc, bt, reqs, seq, qsl, scale, causal_masks)
    t0 = time.perf_counter()
    # (1) the plugin alone on a NaN-poisoned output: tree rows written, other rows untouched
    out1 = torch.full((N, H, D), float("nan"), dtype=dtype, device=device)
    ta._triton_memo.clear()
    ta.triton_tree_attention(q, kc, vc, bt, seq_t, qsl_t, tree_masks, scale, out1,
                             query_start_loc_cpu=qsl, seq_lens_cpu=seq)
    # (2) the forward pass's composition: vLLM's causal call over all rows, then the plugin
    out2 = torch.full((N, H, D), float("nan"), dtype=dtype, device=device)
    ones = torch.ones(1, dtype=torch.float32, device=device)
    tua.unified_attention(q=q, k=kc, v=vc, out=out2, cu_seqlens_q=qsl_t, max_seqlen_q=max(r["rows"] for r in reqs),
                          seqused_k=seq_t, max_seqlen_k=max(seq), softmax_scale=scale, causal=True,
                          window_size=(-1, -1), block_table=bt, softcap=0, q_descale=None, k_descale=ones,
                          v_descale=ones)
    ta.triton_tree_attention(q, kc, vc, bt, seq_t, qsl_t, tree_masks, scale, out2,
                             query_start_loc_cpu=qsl, seq_lens_cpu=seq)
    if device.type == "cuda":
        torch.cuda.synchronize()
    secs = time.perf_counter() - t0

    def errs(out, rows):
        o, r_ = out[rows].float(), ref[rows]
        if o.numel() == 0:
            return {"max_abs": 0.0, "rel_l2": 0.0, "nan": False}
        nan = bool(torch.isnan(o).any())
        d = (o - r_).abs()
        return {"max_abs": float(d.nan_to_num(float("inf")).max()),
                "rel_l2": float((o - r_).nan_to_num(float("inf")).norm() / r_.norm().clamp_min(1e-30)),
                "nan": nan}
    tol = TOLERANCE[case["dtype"]]
    e1 = errs(out1, tree_rows)
    untouched = bool(torch.isnan(out1[~tree_rows]).all()) if bool((~tree_rows).any()) else True
    e2 = errs(out2, torch.ones(N, dtype=torch.bool, device=device))
    ok = lambda e: (not e["nan"]) and e["max_abs"] <= tol["abs"] and e["rel_l2"] <= tol["rel"]  # noqa: E731
    # how far a causal-only (i.e. wrong) mask lands from the reference on the tree rows: the
    # margin the check has to see a mask error, per case
    sens_rows = tree_rows
    sens = float((ref_causal[sens_rows] - ref[sens_rows]).abs().max()) if bool(sens_rows.any()) else 0.0
    per_kind = {}
    for kind in ("tree", "chain", "decode", "causal"):
        rows = torch.zeros(N, dtype=torch.bool)
        for i, r in enumerate(reqs):
            if r["kind"] == kind:
                rows[qsl[i]:qsl[i + 1]] = True
        if bool(rows.any()):
            per_kind[kind] = errs(out2, rows.to(device))["max_abs"]
    groups = {}
    for i in tree_masks:
        groups.setdefault((reqs[i]["rows"], tree_masks[i].cpu().numpy().tobytes()), []).append(i)
    return {
        "dtype": case["dtype"], "block_size": bs, "num_heads": H, "num_kv_heads": Hkv, "head_size": D,
        "seed": case["seed"], "num_requests": len(reqs), "num_rows": N, "num_tree_rows": int(tree_rows.sum()),
        "launches_plugin": len(groups),
        "requests": [{"kind": r["kind"], "rows": r["rows"], "prefix": r["prefix"], "style": r.get("style"),
                      "shared": bool(r.get("shared", False))} for r in reqs],
        "plugin_alone": e1, "untouched_rows_ok": untouched, "composed": e2, "max_abs_by_kind": per_kind,
        "mask_sensitivity_max_abs": sens, "tolerance": tol, "seconds": round(secs, 3),
        "pass": bool(ok(e1) and ok(e2) and untouched),
    }


def kernel_timing_configs(args) -> list[dict]:
    if args.quick:
        return [dict(ctx=32, batch=2, rows=8, heads=(4, 2, 32), dtype=args.interp_dtypes[0], block_size=16)]
    out = []
    for ctx in (512, 2048, 8192):
        for batch in (1, 8, 32):
            for rows in (16, 64):
                out.append(dict(ctx=ctx, batch=batch, rows=rows, heads=(32, 8, 128), dtype="bfloat16", block_size=16))
    return out


def run_kernel_timing(torch, tua, ta, cfg: dict, device, DraftTree, median_ms, reps: int) -> dict:
    rng = random.Random(cfg["ctx"] * 131 + cfg["batch"] * 7 + cfg["rows"])
    gen = torch.Generator(device=device).manual_seed(rng.randint(0, 2 ** 31))
    H, Hkv, D = cfg["heads"]
    bs, B, T, P = cfg["block_size"], cfg["batch"], cfg["rows"], cfg["ctx"]
    dtype = getattr(torch, cfg["dtype"])
    S = P + T
    nblk = (S + bs - 1) // bs
    nb = 1 + B * nblk
    perm = torch.randperm(nb - 1, generator=torch.Generator().manual_seed(rng.randint(0, 2 ** 31))) + 1
    bt = perm.view(B, nblk).to(torch.int32)
    bt = torch.cat([bt, torch.zeros(B, 64 // bs + 1, dtype=torch.int32)], 1).to(device)
    kc = torch.randn(nb, bs, Hkv, D, generator=gen, device=device).to(dtype)
    vc = torch.randn(nb, bs, Hkv, D, generator=gen, device=device).to(dtype)
    q = torch.randn(B * T, H, D, generator=gen, device=device).to(dtype)
    out = torch.empty_like(q)
    seq = [S] * B
    qsl = list(range(0, B * T + 1, T))
    seq_t = torch.tensor(seq, dtype=torch.int32, device=device)
    qsl_t = torch.tensor(qsl, dtype=torch.int32, device=device)
    ones = torch.ones(1, dtype=torch.float32, device=device)
    scale = D ** -0.5
    shared, _, _ = random_tree_mask(rng, DraftTree, T, "random")
    shared_masks = {i: shared.to(device) for i in range(B)}
    mixed_masks = {i: random_tree_mask(rng, DraftTree, T, "random")[0].to(device) for i in range(B)}
    # 1-row decode step of the same requests (the plain step's attention)
    q1 = q[:B].contiguous()
    out1 = torch.empty_like(q1)
    qsl1 = torch.arange(B + 1, dtype=torch.int32, device=device)
    seq1 = torch.full((B,), P + 1, dtype=torch.int32, device=device)
    qq = ta.tree_qq_bias(shared.to(device), device=device)

    def ua(qq_bias=None, qx=q, ox=out, cu=qsl_t, mq=T, sk=seq_t, mk=S):
        tua.unified_attention(q=qx, k=kc, v=vc, out=ox, cu_seqlens_q=cu, max_seqlen_q=mq, seqused_k=sk,
                              max_seqlen_k=mk, softmax_scale=scale, causal=True, window_size=(-1, -1),
                              block_table=bt[:, :], softcap=0, q_descale=None, k_descale=ones, v_descale=ones,
                              qq_bias=qq_bias)

    def plugin(masks):
        return lambda: ta.triton_tree_attention(q, kc, vc, bt, seq_t, qsl_t, masks, scale, out,
                                                query_start_loc_cpu=qsl, seq_lens_cpu=seq)
    res = dict(cfg)
    res["heads"] = list(cfg["heads"])
    res["causal_ms"] = median_ms(lambda: ua(), reps)["ms"]
    res["direct_qq_bias_ms"] = median_ms(lambda: ua(qq), reps)["ms"]
    ta._triton_memo.clear()
    res["plugin_shared_tree_ms"] = median_ms(plugin(shared_masks), reps)["ms"]
    res["plugin_shared_launches"] = 1
    if B > 1:
        ta._triton_memo.clear()
        res["plugin_mixed_trees_ms"] = median_ms(plugin(mixed_masks), reps)["ms"]
        res["plugin_mixed_launches"] = len({m.cpu().numpy().tobytes() for m in mixed_masks.values()})
    res["decode_1row_ms"] = median_ms(lambda: ua(None, q1, out1, qsl1, 1, seq1, P + 1), reps)["ms"]
    res["tree_over_causal"] = res["plugin_shared_tree_ms"] / res["causal_ms"]
    return res


def part_kernel(args, torch, device, budget: Budget, out_dir: Path, env: dict) -> dict:
    res = {"schema": SCHEMA, "part": "kernel", "env": env, "tolerance": TOLERANCE, "cases": [], "timing": [],
           "skipped": [], "errors": []}
    path = out_dir / "kernel_check.json"
    if device.type != "cuda" and not args.interpret:
        res["skipped"].append("no CUDA device and no --interpret: the kernel check needs one of them")
        res["all_pass"] = None
        write_json(path, res)
        return res
    tua, ta, info = load_kernel(args)
    res["kernel"] = info
    DraftTree = draft_tree_cls()
    median_ms = timer(torch, device)
    cases = kernel_cases(args)
    k_budget = min(args.kernel_budget_s, budget.left())
    t0 = time.monotonic()
    bar = progress(len(cases), "kernel check")
    for c in cases:
        if time.monotonic() - t0 > k_budget:
            res["skipped"].append({"case": c, "why": "kernel budget"})
            bar.update()
            continue
        try:
            r = run_kernel_case(torch, tua, ta, c, device, DraftTree, args.fault)
            res["cases"].append(r)
            bar.set_postfix_str(f"{r['dtype']} bs{r['block_size']} {'ok' if r['pass'] else 'FAIL'}")
        except Exception as e:                                     # noqa: BLE001
            res["errors"].append({"case": c, "error": f"{type(e).__name__}: {e}",
                                  "traceback": traceback.format_exc()[-3000:]})
            log(f"kernel case failed to run: {type(e).__name__}: {e}")
        bar.update()
        write_json(path, res)
    bar.close()
    res["num_cases"] = len(res["cases"])
    res["num_failed"] = sum(not r["pass"] for r in res["cases"])
    res["all_pass"] = bool(res["cases"]) and res["num_failed"] == 0 and not res["errors"] and not res["skipped"]
    write_json(path, res)
    if args.no_kernel_timing:
        return res
    cfgs = kernel_timing_configs(args)
    t_budget = min(args.kernel_timing_budget_s, budget.left() - args.curve_reserve_s)
    t1 = time.monotonic()
    reps = 1 if args.interpret else 20
    bar = progress(len(cfgs), "kernel timing")
    for cfg in cfgs:
        if time.monotonic() - t1 > t_budget:
            res["timing"].append(dict(cfg, status="skipped_budget"))
            bar.update()
            continue
        try:
            r = run_kernel_timing(torch, tua, ta, cfg, device, DraftTree, median_ms, reps)
            r["status"] = "ok"
            if args.interpret:
                r["note"] = "Triton interpreter: times are not kernel times"
            res["timing"].append(r)
        except Exception as e:                                     # noqa: BLE001
            res["timing"].append(dict(cfg, status="error", error=f"{type(e).__name__}: {e}"))
            if device.type == "cuda":
                torch.cuda.empty_cache()
        bar.update()
    bar.close()
    write_json(path, res)
    return res


# ---------------------------------------------------------------------------------------------
# part 0 (CPU only): compile the GPU run's kernel variants for Hopper without a GPU
# ---------------------------------------------------------------------------------------------

def part_compile(args, torch, out_dir: Path, env: dict) -> dict:
    """Ahead-of-time compile (Triton -> PTX -> cubin with Triton's own ptxas) of every
    unified_attention variant the GPU run's kernel cases launch, for sm_90 (H100/H200), with a
    stand-in driver: proves the installed Triton compiles vLLM's kernel for Hopper, and reads the
    resource usage (registers, spills, shared memory) off the cubin. Nothing runs. Runs in its own
    process (it replaces Triton's active driver); never under TRITON_INTERPRET."""
    path = out_dir / "compile_check.json"
    res = {"schema": SCHEMA, "part": "compile", "env": env, "target": f"cuda:{args.compile_arch}", "variants": [],
           "errors": []}
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    class _StandInDriver:                      # what JITFunction.run asks of the active driver
        def get_current_target(self):
            return GPUTarget("cuda", args.compile_arch, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

        def is_active(self):
            return True

    driver.set_active(_StandInDriver())
    compiled = []
    orig_run = JITFunction.run

    def run(self, *a, grid, warmup, **k):      # compile, never launch
        kern = orig_run(self, *a, grid=grid, warmup=True, **k)
        compiled.append(kern)
        return kern
    JITFunction.run = run
    tua, _, info = load_kernel(args)
    res["kernel"] = info
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    variants = []
    for c in kernel_cases(argparse.Namespace(quick=False)):
        v = (c["dtype"], c["block_size"], tuple(c["heads"]))
        if v not in variants:
            variants.append(v)
    import tempfile
    tmp = Path(tempfile.mkdtemp(prefix="gpu_check_cubin_"))
    for dt, bs, (H, Hkv, D) in variants:
        for use_qq in (True, False):
            rec = {"dtype": dt, "block_size": bs, "num_heads": H, "num_kv_heads": Hkv, "head_size": D,
                   "qq_bias": use_qq}
            try:
                dtype = getattr(torch, dt)
                T, P = 64, 300
                nb = (P + T) // bs + 4
                q = torch.zeros(T, H, D, dtype=dtype)
                kc = torch.zeros(nb, bs, Hkv, D, dtype=dtype)
                one = torch.ones(1)
                t0 = time.perf_counter()
                n0 = len(compiled)
                tua.unified_attention(
                    q=q, k=kc, v=kc.clone(), out=torch.empty_like(q),
                    cu_seqlens_q=torch.tensor([0, T], dtype=torch.int32), max_seqlen_q=T,
                    seqused_k=torch.tensor([P + T], dtype=torch.int32), max_seqlen_k=P + T,
                    softmax_scale=D ** -0.5, causal=True, window_size=(-1, -1),
                    block_table=torch.arange(nb, dtype=torch.int32)[None], softcap=0, q_descale=None, k_descale=one,
                    v_descale=one, qq_bias=torch.zeros(T + 16, T) if use_qq else None)
                kern = compiled[n0]
                md = kern.metadata
                rec.update(seconds=round(time.perf_counter() - t0, 2), num_warps=md.num_warps,
                           num_stages=md.num_stages, shared_bytes=md.shared, ok=True,
                           ptx_lines=kern.asm["ptx"].count("\n"))
                cub = tmp / f"k{len(compiled)}.cubin"
                cub.write_bytes(kern.asm["cubin"])
                try:
                    txt = subprocess.run([str(cuobjdump), "-res-usage", str(cub)], capture_output=True, text=True,
                                         timeout=60).stdout
                    for line in txt.splitlines():
                        if "REG:" in line:
                            f = dict(x.split(":", 1) for x in line.split() if ":" in x)
                            rec.update(registers=int(f.get("REG", -1)), stack=int(f.get("STACK", -1)),
                                       local_bytes=int(f.get("LOCAL", -1)))
                            break
                except Exception as e:                             # noqa: BLE001
                    rec["res_usage_error"] = f"{type(e).__name__}: {e}"
            except Exception as e:                                 # noqa: BLE001
                rec.update(ok=False, error=f"{type(e).__name__}: {str(e)[:1500]}")
                res["errors"].append(traceback.format_exc()[-3000:])
            res["variants"].append(rec)
            log(f"compile sm_{args.compile_arch} {dt} bs{bs} H{H}/{Hkv}/{D} qq={use_qq}: "
                + (f"ok {rec['seconds']} s, {rec.get('registers')} regs, {rec['shared_bytes']} B shared, "
                   f"local {rec.get('local_bytes')}" if rec["ok"] else rec["error"][:200]))
    JITFunction.run = orig_run
    res["all_ok"] = bool(res["variants"]) and all(v["ok"] for v in res["variants"])
    write_json(path, res)
    return res


def spawn_compile(args, out_dir: Path) -> dict | None:
    """part_compile in a child process without TRITON_INTERPRET (the interpreter replaces jit)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, str(Path(__file__).resolve()), str(out_dir), "--parts", "compile",
           "--bundle", args.bundle, "--vllm", args.vllm, "--compile-arch", str(args.compile_arch)]
    if args.quick:
        cmd.append("--quick")
    t = time.monotonic()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    tail = "\n".join(ln for ln in (p.stdout + p.stderr).splitlines() if "Warning" not in ln
                     and "is_query_key" not in ln)[-4000:]
    log(tail)
    log(f"compile part: {time.monotonic() - t:.1f} s (child rc {p.returncode})")
    f = out_dir / "compile_check.json"
    return json.loads(f.read_text()) if f.exists() else None


# ---------------------------------------------------------------------------------------------
# part 2: the verification-cost curve
# ---------------------------------------------------------------------------------------------

CURVE_WHAT = (
    "median ms of one forward of the whole model (B requests x q query tokens each, over ctx cached tokens, "
    "logits for every query token); chain = causal, tree = one random tree shape per cell, shared by the "
    "batch (a static tree), positions ctx + depth. attn 'triton': every layer's attention is vLLM's Triton "
    "unified_attention over a paged cache (block 16, shuffled blocks), the tree as qq_bias: one launch per "
    "layer, the plugin's static-tree GPU path; new K/V are scattered into their slots like vLLM's "
    "reshape_and_cache. attn 'sdpa': transformers' SDPA path with a 4-D additive mask over a contiguous "
    "cache; with a mask transformers repeats K/V to all query heads (repeat_kv), so its cost grows with "
    "context faster than a GQA kernel's: a plain-PyTorch reference, not vLLM's cost.")


def make_cache_classes():
    """Two KV caches of fixed addresses for one (batch, context): each step writes its q tokens at
    positions ctx..ctx+q-1 and attends to the first ctx+q positions, so repeated steps (and CUDA
    graph replays) are identical. Duck-typed to what LlamaModel / LlamaAttention use (update /
    get_seq_length / is_sliding), on top of transformers' Cache where it exists.
    FixedKVCache: [B, Hkv, ctx + q_max, D] per layer (the SDPA path). PagedKVCache: vLLM's Triton
    layout [num_blocks, block_size, Hkv, D] with a shuffled block table (block 0 = null block)."""
    try:
        from transformers.cache_utils import Cache as _Base
    except Exception:                                              # pragma: no cover
        _Base = object

    class _Common(_Base):
        is_compileable = False

        @property
        def is_sliding(self):
            return [False] * self.n_layers

        def __len__(self):
            return self.n_layers

        def get_seq_length(self, layer_idx=0):
            return self.ctx

        def get_mask_sizes(self, *a, **k):
            raise RuntimeError("these caches are used with a prepared 4-D mask only")

    class FixedKVCache(_Common):
        def __init__(self, torch, n_layers, B, Hkv, D, ctx, q_max, dtype, device, gen=None):
            # (no super().__init__: its signature differs across transformers versions)
            self.ctx, self.n_layers = ctx, n_layers
            shape = (B, Hkv, ctx + q_max, D)
            self.k = [torch.randn(shape, dtype=dtype, device=device, generator=gen) for _ in range(n_layers)]
            self.v = [torch.randn(shape, dtype=dtype, device=device, generator=gen) for _ in range(n_layers)]

        def set_step(self, q, qq_bias=None):
            pass

        def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
            q, s = key_states.shape[-2], self.ctx
            self.k[layer_idx][:, :, s:s + q].copy_(key_states)
            self.v[layer_idx][:, :, s:s + q].copy_(value_states)
            return self.k[layer_idx][:, :, :s + q], self.v[layer_idx][:, :, :s + q]

    class PagedKVCache(_Common):
        def __init__(self, torch, n_layers, B, Hkv, D, ctx, q_max, dtype, device, gen=None, block_size=16):
            self.torch, self.ctx, self.n_layers = torch, ctx, n_layers
            self.B, self.bs, self.device = B, block_size, device
            nblk = (ctx + q_max + block_size - 1) // block_size
            nb = 1 + B * nblk
            perm = torch.randperm(nb - 1, generator=torch.Generator().manual_seed(ctx * 7 + B)) + 1
            bt = torch.cat([perm.view(B, nblk), torch.zeros(B, 64 // block_size + 1, dtype=perm.dtype)], 1)
            self.block_table = bt.to(device=device, dtype=torch.int32)
            shape = (nb, block_size, Hkv, D)
            self.kc = [torch.randn(shape, dtype=dtype, device=device, generator=gen) for _ in range(n_layers)]
            self.vc = [torch.randn(shape, dtype=dtype, device=device, generator=gen) for _ in range(n_layers)]
            self.ones = torch.ones(1, dtype=torch.float32, device=device)
            self.q = None

        def set_step(self, q, qq_bias=None):
            """This step's metadata: B requests of q rows after ctx cached tokens; qq_bias: the tree's
            (tree_qq_bias) or None (causal)."""
            torch, B = self.torch, self.B
            pos = torch.arange(self.ctx, self.ctx + q, device=self.device)
            self.slot_blk = self.block_table[:, pos // self.bs].reshape(-1).long()
            self.slot_off = (pos % self.bs).repeat(B)
            self.cu = torch.arange(0, (B + 1) * q, q, dtype=torch.int32, device=self.device)
            self.seq = torch.full((B,), self.ctx + q, dtype=torch.int32, device=self.device)
            self.q, self.qq = q, qq_bias

        def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
            B, Hkv, q, D = key_states.shape
            assert q == self.q, "set_step(q) before the forward"
            self.kc[layer_idx][self.slot_blk, self.slot_off] = key_states.transpose(1, 2).reshape(B * q, Hkv, D)
            self.vc[layer_idx][self.slot_blk, self.slot_off] = value_states.transpose(1, 2).reshape(B * q, Hkv, D)
            return key_states, value_states

    return FixedKVCache, PagedKVCache


_TRITON_HOLDER: dict = {}


def register_triton_attention(tua) -> str:
    """transformers attention function 'vllm_triton': vLLM's unified_attention over the current
    PagedKVCache (set in _TRITON_HOLDER['cache']) with its step's qq_bias. Returns the name."""
    from transformers import AttentionInterface

    def vllm_triton_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        import torch
        cache = _TRITON_HOLDER["cache"]
        _TRITON_HOLDER["calls"] = _TRITON_HOLDER.get("calls", 0) + 1
        B, H, q, D = query.shape
        q2 = query.transpose(1, 2).reshape(B * q, H, D)
        out = torch.empty_like(q2)
        L = module.layer_idx
        tua.unified_attention(
            q=q2, k=cache.kc[L], v=cache.vc[L], out=out, cu_seqlens_q=cache.cu, max_seqlen_q=q,
            seqused_k=cache.seq, max_seqlen_k=cache.ctx + q,
            softmax_scale=scaling if scaling is not None else D ** -0.5, causal=True, window_size=(-1, -1),
            block_table=cache.block_table, softcap=0, q_descale=None, k_descale=cache.ones, v_descale=cache.ones,
            qq_bias=cache.qq)
        return out.view(B, q, H, D), None
    AttentionInterface.register("vllm_triton", vllm_triton_attention)
    return "vllm_triton"


def set_attn(model, name: str) -> None:
    for mod in model.modules():                 # every config object the layers hold
        c = getattr(mod, "config", None)
        if c is not None and getattr(c, "_attn_implementation", None) != name:
            c._attn_implementation = name


def build_model(torch, args, device):
    from transformers import LlamaConfig, LlamaForCausalLM
    shape = TINY if args.quick else LLAMA3_8B
    cfg = LlamaConfig(**shape, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):                # weights made on the device, never on the host
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    moved = False
    if any(p.device.type != device.type for p in model.parameters()):     # (a transformers that ignores it)
        model.to(device)
        moved = True
    model.eval()
    n = sum(p.numel() for p in model.parameters())
    dts = sorted({str(p.dtype) for p in model.parameters()})
    devs = sorted({str(p.device) for p in model.parameters()})
    return model, cfg, {"shape": shape, "params": n, "param_dtypes": dts, "param_devices": devs,
                        "moved_after_init": moved, "weights": "random (transformers init), bf16"}


def curve_grid(args, attn: str):
    """(batches, contexts, q_lens) of one attention mode."""
    if args.quick:
        if attn == "triton" and args.interpret:           # the interpreter runs every program in Python
            return (1,), (64,), (1, 4)
        return (1, 4), (64, 256), (1, 4, 16)
    return (1, 8, 32, 64), (512, 2048, 8192), (1, 2, 4, 8, 16, 32, 64)


def curve_cells(args, attns) -> list[tuple]:
    """Cells in priority order: batches 1 and 8 of every attention mode first, then the rest."""
    groups = []
    for small in (True, False):
        for attn in attns:
            batches, ctxs, qs = curve_grid(args, attn)
            for B in batches:
                if (B <= 8) != small:
                    continue
                for ctx in ctxs:
                    for q in qs:
                        for kind in (("chain",) if q == 1 else ("chain", "tree")):
                            groups.append((attn, B, ctx, q, kind))
    return groups


def step_inputs(torch, rng, DraftTree, B, q, ctx, kind, vocab, device, dtype):
    """ids [B, q], the 4-D additive mask [B, 1, q, ctx + q], positions [B, q] and the [q, q] mask
    (one tree shape for the whole batch)."""
    ids = torch.randint(0, vocab, (B, q), device=device)
    m, d, _ = random_tree_mask(rng, DraftTree, q, "chain" if kind == "chain" else None)
    mask = torch.zeros(B, 1, q, ctx + q, dtype=dtype)
    mask[:, 0, :, ctx:] = torch.zeros(q, q, dtype=dtype).masked_fill(~m, float("-inf"))
    pos = (ctx + torch.tensor(d)).expand(B, q).contiguous().to(device)
    return ids, mask.to(device), pos, m


def kv_bytes(cfg, B, ctx, q_max, block=16):
    hd = cfg.hidden_size // cfg.num_attention_heads
    slots = ((ctx + q_max + block - 1) // block + 1) * block
    return 2 * cfg.num_hidden_layers * B * cfg.num_key_value_heads * slots * hd * 2


def act_bytes(cfg, B, q, ctx, attn):
    T = B * q
    b = T * cfg.vocab_size * 2 * 3 + T * cfg.intermediate_size * 2 * 4 + (1 << 28)
    if attn == "sdpa":       # repeat_kv copies of one layer's K/V + a possible math-kernel score matrix
        hd = cfg.hidden_size // cfg.num_attention_heads
        b += 2 * B * cfg.num_attention_heads * (ctx + q) * hd * 2 * 2
        b += B * cfg.num_attention_heads * q * (ctx + q) * 4 * 2
    return b


def time_cell(torch, model, cache, ids, mask, pos, device, median_ms, use_graph: bool, target_s: float) -> dict:
    def fwd():
        return model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                     use_cache=True).logits
    g = None
    if device.type == "cuda" and use_graph:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                fwd()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fwd()
        fn, mode = g.replay, "cuda_graph"
    else:
        fwd()
        fn, mode = fwd, "eager"
    one = median_ms(fn, 1, warmup=1)["ms"]
    reps = max(3, min(30, int(target_s * 1e3 / max(one, 1e-3))))
    r = median_ms(fn, reps, warmup=1)
    r["mode"] = mode
    del g
    return r


def mask_sanity(torch, model, cfg, make_cache, device, dtype, qq_of) -> dict:
    """Does the model honour the tree mask? A tree step's row for node t must equal the last row of
    a chain step over t's path (same cached prefix, positions ctx + depth); the row a plain causal
    mask gives (rows 0..t) must differ by far more. qq_of(mask) -> the cache's set_step bias."""
    DraftTree = draft_tree_cls()
    ctx, q = 48, 8
    t = DraftTree([0] * 7, [-1, 0, 0, 1, -1, 4, 2])          # node 6's path: 0, 2, 6 (depth 3)
    cache = make_cache(1, ctx, q)
    gen = torch.Generator(device=device).manual_seed(7)
    ids = torch.randint(0, cfg.vocab_size, (1, q), device=device, generator=gen)

    def step(rows_ids, allowed, depths, tree):
        n = allowed.shape[0]
        m = torch.zeros(1, 1, n, ctx + n, dtype=dtype)
        m[0, 0, :, ctx:] = torch.zeros(n, n, dtype=dtype).masked_fill(~allowed, float("-inf"))
        cache.set_step(n, qq_of(allowed) if tree else None)
        pos = (ctx + torch.tensor(depths))[None].to(device)
        return model(input_ids=rows_ids, attention_mask=m.to(device), position_ids=pos, past_key_values=cache,
                     use_cache=True).logits[0].float()
    with torch.inference_mode():
        tree = step(ids, t.ancestor_mask(), [0] + t.depths, True)
        path_rows = [0] + [p + 1 for p in t.path(6)]              # rows 0, 1, 3, 7
        chain = step(ids[:, path_rows], torch.ones(4, 4, dtype=torch.bool).tril(), [0, 1, 2, 3], False)
        causal = step(ids, torch.ones(q, q, dtype=torch.bool).tril(), list(range(q)), False)
    err = float((tree[7] - chain[-1]).abs().max())
    wrong = float((causal[7] - chain[-1]).abs().max())
    return {"tree_row_vs_chain_path_max_abs": err, "causal_row_vs_chain_path_max_abs": wrong,
            "logit_scale": float(tree[7].abs().max()), "pass": bool(err <= 0.25 * wrong)}


def part_curve(args, torch, device, budget: Budget, out_dir: Path, env: dict) -> dict:
    path = out_dir / "cost_curve.json"
    res = {"schema": SCHEMA, "part": "curve", "env": env, "cells": [], "errors": [], "what": CURVE_WHAT,
           "mask_sanity": {}}
    if device.type != "cuda" and not args.quick:
        res["errors"].append("no CUDA device: the full curve runs on a GPU only (use --quick on CPU)")
        write_json(path, res)
        return res
    import transformers  # noqa: F401
    attns = list(args.curve_attn)
    if "triton" in attns and device.type != "cuda" and not args.interpret:
        attns.remove("triton")
        res["errors"].append("attn triton skipped: no CUDA device and no --interpret")
    t0 = time.monotonic()
    model, cfg, minfo = build_model(torch, args, device)
    minfo["build_s"] = round(time.monotonic() - t0, 2)
    res["model"] = minfo
    log(f"model: {minfo['params'] / 1e9:.2f}B params {minfo['param_dtypes']} on {minfo['param_devices']} "
        f"in {minfo['build_s']} s")
    FixedKVCache, PagedKVCache = make_cache_classes()
    DraftTree = draft_tree_cls()
    median_ms = timer(torch, device)
    hd = cfg.hidden_size // cfg.num_attention_heads
    # the interpreter multiplies bf16 dot operands as raw bits: fp16 for Triton-attention cells there
    dtype_of = {a: (torch.float16 if (a == "triton" and args.interpret) else torch.bfloat16) for a in attns}
    ta = None
    if "triton" in attns:
        tua, ta, kinfo = load_kernel(args)
        res["kernel"] = kinfo
        triton_name = register_triton_attention(tua)
    gen = torch.Generator(device=device).manual_seed(1234)
    q_max = 64 if not args.quick else 16
    current = {"dtype": torch.bfloat16}

    def use(attn):
        dt = dtype_of[attn]
        if current["dtype"] != dt:
            model.to(dt)
            current["dtype"] = dt
        set_attn(model, triton_name if attn == "triton" else "sdpa")

    def make_cache(attn, B, ctx, qm):
        if attn == "triton":
            c = PagedKVCache(torch, cfg.num_hidden_layers, B, cfg.num_key_value_heads, hd, ctx, qm, dtype_of[attn],
                             device, gen)
            _TRITON_HOLDER["cache"] = c
            return c
        return FixedKVCache(torch, cfg.num_hidden_layers, B, cfg.num_key_value_heads, hd, ctx, qm, dtype_of[attn],
                            device, gen)

    def qq_of(m):
        return ta.tree_qq_bias(m.to(device), device=device) if ta is not None else None

    for attn in attns:
        try:
            use(attn)
            res["mask_sanity"][attn] = mask_sanity(torch, model, cfg, lambda B, c, q: make_cache(attn, B, c, q),
                                                   device, dtype_of[attn], qq_of)
            log(f"curve mask sanity ({attn}): {res['mask_sanity'][attn]}")
        except Exception as e:                                     # noqa: BLE001
            res["mask_sanity"][attn] = {"pass": False, "error": f"{type(e).__name__}: {e}"}
            res["errors"].append({"mask_sanity": attn, "traceback": traceback.format_exc()[-3000:]})
            log(f"curve mask sanity ({attn}) failed: {type(e).__name__}: {e}")
    res["mask_sanity_pass"] = bool(res["mask_sanity"]) and all(v.get("pass") for v in res["mask_sanity"].values())
    cells = curve_cells(args, attns)
    eager_ref = set()
    if device.type == "cuda" and args.graphs == "auto":     # eager next to graphs for a few cells
        eager_ref = {(a, 1, 2048, q, "chain") for a in attns for q in (1, 8, 64)}
    res["grid"] = {a: dict(zip(("batches", "contexts", "q_lens"), curve_grid(args, a))) for a in attns}
    res["grid_note"] = "q=1: chain only (a 1-row tree is the same step)"
    use_graph = {a: device.type == "cuda" and args.graphs == "auto" for a in attns}   # per attention path
    rng = random.Random(1234)
    bar = progress(len(cells), "cost curve")
    cache, cache_key = None, None
    target_s = 0.02 if args.quick else 0.15
    last_write = time.monotonic()
    with torch.inference_mode():
        for (attn, B, ctx, q, kind) in cells:
            rec = {"attn": attn, "batch": B, "ctx": ctx, "q_len": q, "mask": kind}
            if budget.left() < args.reserve_s:
                rec["status"] = "skipped_budget"
                res["cells"].append(rec)
                bar.update()
                continue
            if device.type == "cuda":
                # free once the current cache is dropped: the driver's free memory, what PyTorch
                # holds unused in its cache, and the current cache itself
                free = (torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
                        + (kv_bytes(cfg, cache_key[1], cache_key[2], q_max) if cache_key is not None else 0))
                need = kv_bytes(cfg, B, ctx, q_max) + act_bytes(cfg, B, q, ctx, attn)
                if need > 0.92 * free:
                    rec.update(status="skipped_memory", need_gib=round(need / 2 ** 30, 1),
                               free_gib=round(free / 2 ** 30, 1))
                    res["cells"].append(rec)
                    bar.update()
                    continue
            try:
                use(attn)
                if cache_key != (attn, B, ctx):
                    cache = None
                    _TRITON_HOLDER.pop("cache", None)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                    cache = make_cache(attn, B, ctx, q_max)
                    cache_key = (attn, B, ctx)
                ids, mask, pos, m = step_inputs(torch, rng, DraftTree, B, q, ctx, kind, cfg.vocab_size, device,
                                                dtype_of[attn])
                cache.set_step(q, qq_of(m) if kind == "tree" else None)
                try:
                    r = time_cell(torch, model, cache, ids, mask, pos, device, median_ms, use_graph[attn], target_s)
                except Exception as e:                             # noqa: BLE001
                    if not use_graph[attn] or "out of memory" in str(e).lower():
                        raise
                    use_graph[attn] = False                        # capture failed: eager from here on
                    res["errors"].append({"cell": dict(rec), "graph_capture_failed": f"{type(e).__name__}: {e}",
                                          "traceback": traceback.format_exc()[-3000:]})
                    log(f"CUDA graph capture failed ({type(e).__name__}: {str(e)[:200]}): eager from here on")
                    torch.cuda.synchronize()
                    r = time_cell(torch, model, cache, ids, mask, pos, device, median_ms, False, target_s)
                rec.update(r)
                rec["status"] = "ok"
                rec["tokens"] = B * q
                if (attn, B, ctx, q, kind) in eager_ref and use_graph[attn]:
                    rec["eager_ms"] = time_cell(torch, model, cache, ids, mask, pos, device, median_ms, False,
                                                target_s)["ms"]
            except Exception as e:                                 # noqa: BLE001
                oom = "out of memory" in str(e).lower() or type(e).__name__ == "OutOfMemoryError"
                rec["status"] = "oom" if oom else "error"
                rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                if not oom:
                    res["errors"].append({"cell": dict(rec), "traceback": traceback.format_exc()[-3000:]})
                cache, cache_key = None, None
                _TRITON_HOLDER.pop("cache", None)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.empty_cache()
            res["cells"].append(rec)
            bar.update()
            if time.monotonic() - last_write > 20:
                write_json(path, res)
                last_write = time.monotonic()
    bar.close()
    cache = model = None      # freed before the next part
    res["triton_attention_python_calls"] = _TRITON_HOLDER.get("calls", 0)   # (graph replays make none)
    _TRITON_HOLDER.clear()
    st = [c["status"] for c in res["cells"]]
    res["counts"] = {s: st.count(s) for s in sorted(set(st))}
    res["cuda_graphs"] = use_graph
    write_json(path, res)
    return res


# ---------------------------------------------------------------------------------------------
# summary
# ---------------------------------------------------------------------------------------------

def summary(kr: dict | None, cr: dict | None, pr: dict | None = None) -> None:
    log("\n===== gpu_check summary =====")
    if pr is not None:
        ok = [v for v in pr["variants"] if v.get("ok")]
        regs = sorted({v.get("registers") for v in ok if v.get("registers") is not None})
        log(f"compile ({pr['target']}, Triton {pr['env'].get('triton')}): {len(ok)}/{len(pr['variants'])} "
            f"variants ok; registers {regs}; local bytes {sorted({v.get('local_bytes') for v in ok})}")
    if kr is not None:
        if kr.get("all_pass") is None:
            log(f"kernel: skipped ({kr.get('skipped')})")
        else:
            worst = max((max(c["plugin_alone"]["rel_l2"], c["composed"]["rel_l2"]) for c in kr["cases"]), default=0)
            log(f"kernel: {kr['num_cases']} cases, {kr['num_failed']} failed, {len(kr['errors'])} errors, "
                f"{len(kr['skipped'])} skipped; worst rel err {worst:.2e}; ALL PASS = {kr['all_pass']}")
            for c in kr["cases"]:
                if not c["pass"]:
                    log(f"  FAIL {c['dtype']} bs{c['block_size']} H{c['num_heads']}/{c['num_kv_heads']} "
                        f"seed {c['seed']}: alone {c['plugin_alone']} composed {c['composed']} "
                        f"untouched {c['untouched_rows_ok']}")
            t = [r for r in kr["timing"] if r.get("status") == "ok"]
            if t:
                log("kernel timing (ms): ctx batch rows | causal | tree (1 launch) | tree/causal | mixed trees "
                    "(launches) | 1-row decode")
                for r in t:
                    mixed = (f"{r['plugin_mixed_trees_ms']:.3f} ({r['plugin_mixed_launches']})"
                             if "plugin_mixed_trees_ms" in r else "-")
                    log(f"  {r['ctx']:>5} {r['batch']:>3} {r['rows']:>3} | {r['causal_ms']:.3f} | "
                        f"{r['plugin_shared_tree_ms']:.3f} | {r['tree_over_causal']:.2f} | {mixed} | "
                        f"{r['decode_1row_ms']:.3f}")
    if cr is not None:
        cells = [c for c in cr.get("cells", []) if c.get("status") == "ok"]
        log(f"curve: {cr.get('counts')} cuda_graphs={cr.get('cuda_graphs')} errors={len(cr.get('errors', []))} "
            f"mask sanity pass={cr.get('mask_sanity_pass')}")
        by = {}
        for c in cells:
            by.setdefault((c["attn"], c["batch"], c["ctx"]), {})[(c["q_len"], c["mask"])] = c["ms"]
        if by:
            qs = sorted({c["q_len"] for c in cells})
            log("step ms of the chain (tree/chain) per q_len: " + " ".join(f"q{q}" for q in qs))
            for (attn, B, ctx), d in sorted(by.items()):
                parts = []
                for q in qs:
                    ch, tr = d.get((q, "chain")), d.get((q, "tree"))
                    parts.append("-" if ch is None else f"{ch:.2f}" + (f"({tr / ch:.2f})" if tr else ""))
                log(f"  {attn:<6} B{B:<3} ctx{ctx:<5} " + " ".join(parts))


# ---------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", help="folder for kernel_check.json and cost_curve.json (created)")
    p.add_argument("--quick", action="store_true", help="tiny shapes and a handful of cells (CPU rehearsal)")
    p.add_argument("--interpret", action="store_true",
                   help="TRITON_INTERPRET=1: the kernel check on Triton's CPU interpreter (few tiny cases)")
    p.add_argument("--budget-s", type=float, default=400.0,
                   help="wall-clock budget of the whole run; curve cells past it are recorded as skipped "
                        "(default 400: fits an 8-minute device call with start-up to spare)")
    p.add_argument("--kernel-budget-s", type=float, default=150.0, help="cap for the kernel correctness cases")
    p.add_argument("--kernel-timing-budget-s", type=float, default=45.0, help="cap for the kernel timings")
    p.add_argument("--curve-reserve-s", type=float, default=150.0,
                   help="time kept for the curve when deciding whether kernel timings may start")
    p.add_argument("--reserve-s", type=float, default=10.0, help="stop curve cells this long before the budget")
    p.add_argument("--parts", default="auto",
                   help="comma list of kernel, curve, compile (compile: CPU only, sm_90 cubins without a GPU). "
                        "auto: kernel,curve on a GPU; kernel,curve,compile without one")
    p.add_argument("--compile-arch", type=int, default=90, help="compute capability for --parts compile")
    p.add_argument("--vllm", choices=("bundle", "installed"), default="bundle",
                   help="where unified_attention comes from: the .gpu_bundle folder or an installed vLLM")
    p.add_argument("--bundle", default=str(DEFAULT_BUNDLE), help="bundle folder (scripts/gpu_bundle.py)")
    p.add_argument("--graphs", choices=("auto", "off"), default="auto", help="CUDA graphs for the curve")
    p.add_argument("--curve-attn", default="triton,sdpa",
                   help="attention of the curve's model: triton (vLLM's unified_attention, paged, qq_bias) "
                        "and/or sdpa (transformers' SDPA with a 4-D mask)")
    p.add_argument("--no-kernel-timing", action="store_true")
    p.add_argument("--fault", choices=("none", "mask"), default="none",
                   help="testing: hand the kernel a wrong (transposed) tree mask; the check must fail")
    p.add_argument("--interp-dtypes", default="float16,float32",
                   help="dtypes of the --quick kernel cases (comma list). Not bfloat16 under --interpret: "
                        "Triton's interpreter multiplies bf16 tl.dot operands as raw bits (errors ~1e9 on "
                        "any bf16 dot, seen with Triton 3.9); the GPU run checks bf16")
    a = p.parse_args(argv)
    a.interp_dtypes = [d for d in a.interp_dtypes.split(",") if d]
    a.parts = [x for x in a.parts.split(",") if x]
    a.curve_attn = [x for x in a.curve_attn.split(",") if x]
    return a


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"       # before anything imports triton
    budget = Budget(args.budget_s)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    import torch
    device = torch.device("cuda") if torch.cuda.is_available() and not args.interpret else torch.device("cpu")
    if args.quick and not args.interpret and torch.cuda.is_available():
        device = torch.device("cuda")
    env = environment(torch, Path(args.bundle) if args.vllm == "bundle" else None, args)
    env["run_device"] = str(device)
    env["budget_s"] = args.budget_s
    log(f"gpu_check: {env['device']} torch {env['torch']} triton {env.get('triton')} "
        f"transformers {env.get('transformers')} git {env['git']['sha']} -> {out_dir}")
    torch.manual_seed(0)
    if args.parts == ["auto"]:
        args.parts = ["kernel", "curve"] + ([] if torch.cuda.is_available() else ["compile"])
    kr = cr = pr = None
    if args.parts == ["compile"] and not args.interpret:      # the child process of spawn_compile
        pr = part_compile(args, torch, out_dir, env)
        return 0 if pr["all_ok"] else 1
    if "compile" in args.parts:
        pr = spawn_compile(args, out_dir)
    if "kernel" in args.parts:
        t = time.monotonic()
        kr = part_kernel(args, torch, device, budget, out_dir, env)
        log(f"kernel part: {time.monotonic() - t:.1f} s")
    if "curve" in args.parts:
        t = time.monotonic()
        cr = part_curve(args, torch, device, budget, out_dir, env)
        log(f"curve part: {time.monotonic() - t:.1f} s")
    summary(kr, cr, pr)
    log(f"total {budget.elapsed():.1f} s; JSON in {out_dir}")
    if kr is not None and kr.get("all_pass") is False:
        return 1
    if pr is not None and not pr.get("all_ok"):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
