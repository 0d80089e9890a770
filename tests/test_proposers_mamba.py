"""The Mamba drafter alone (pure torch): parallel scan == recurrence, snapshots roll back exactly,
per-request memory is flat in the context length, the proposer drafts what the drafter predicts."""
import numpy as np
import pytest
import torch

from vllm_spec_plugins.proposers.base import RequestStep, StepContext
from vllm_spec_plugins.proposers.mamba import MambaProposer, StateSpaceDrafter, greedy_chain_accepted, ssd_scan

V, D = 300, 32


def drafter(kind="mamba", seed=0, **kw):
    torch.manual_seed(seed)
    emb = torch.randn(V, D)
    d = StateSpaceDrafter({"kind": kind, "head_dim": 16, "d_state": 8, "chunk": 8, "n_heads": 4,
                           "n_kv_heads": 2, "mlp": 48, **kw}, emb, emb, torch.arange(0, V, 2))
    with torch.no_grad():     # make the recurrence matter: non-trivial decay and mixing
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return d.eval()


def test_chunked_scan_equals_recurrence():
    torch.manual_seed(0)
    b, T, H, P, N = 2, 29, 3, 4, 5
    x, B, C = torch.randn(b, T, H, P), torch.randn(b, T, N), torch.randn(b, T, N)
    dt, A = torch.rand(b, T, H), -torch.rand(H) * 2
    h0 = torch.randn(b, H, P, N)
    y, hT = ssd_scan(x, dt, A, B, C, chunk=8, h0=h0)
    h, ys = h0, []
    for t in range(T):
        h = (torch.exp(dt[:, t] * A)[..., None, None] * h
             + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, None, None])
        ys.append((h * C[:, t, None, None]).sum(-1))
    torch.testing.assert_close(y, torch.stack(ys, 1), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(hT, h, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["mamba", "transformer"])
def test_prefill_then_steps_equals_one_pass(kind):
    d = drafter(kind)
    ids = torch.randint(0, V, (1, 37))
    with torch.no_grad():
        full, _ = d(ids)
        h, st = d(ids[:, :20])
        outs = [h[:, -1]]
        for t in range(20, 37):
            h1, st = d.step(ids[:, t], st)
            outs.append(h1)
    torch.testing.assert_close(torch.stack(outs[1:], 1), full[:, 20:], rtol=1e-4, atol=1e-4)
    assert d.logits(full).shape[-1] == V // 2


def test_state_is_flat_in_context_for_mamba_and_grows_for_attention():
    sizes = {}
    for kind in ("mamba", "transformer"):
        d = drafter(kind)
        with torch.no_grad():
            sizes[kind] = [d.state_nbytes(d(torch.randint(0, V, (1, n)))[1]) for n in (64, 256)]
    assert sizes["mamba"][0] == sizes["mamba"][1]
    assert sizes["transformer"][1] == 4 * sizes["transformer"][0]


def _run(prop, d, prompts, answers, ks=None):
    """Drive the proposer as the runner would, the target greedily emitting `answers`:
    returns drafts per step per request and accepted totals."""
    pos = {r: 1 for r in prompts}                              # tokens of the answer emitted so far
    last = {r: [] for r in prompts}
    acc = {r: 0 for r in prompts}
    steps = {r: 0 for r in prompts}
    while any(pos[r] < len(answers[r]) for r in prompts):
        reqs = []
        for r in prompts:
            if pos[r] >= len(answers[r]):
                continue
            if last[r]:
                drafts, a = last[r], 0
                while a < len(drafts) and pos[r] + a < len(answers[r]) and drafts[a] == answers[r][pos[r] + a]:
                    a += 1
                n_new = min(a + 1, len(answers[r]) - pos[r])
                sampled = answers[r][pos[r]: pos[r] + n_new]
                acc[r] += a
                steps[r] += 1
                pos[r] += n_new
                if pos[r] >= len(answers[r]):
                    continue
            else:
                drafts, sampled = [], [answers[r][0]]
            toks = np.array(prompts[r] + answers[r][:pos[r]])
            reqs.append(RequestStep(r, toks, sampled, drafts))
        if not reqs:
            break
        out = prop.propose(StepContext(reqs, set(), set(), prop.k))
        for q, o in zip(reqs, out):
            last[q.req_id] = o
    return acc, steps


def _partly_predicted(d, prompt, n, every):
    """An answer the drafter partly predicts: its own greedy continuation of `prompt`, n tokens,
    with every `every`-th token changed."""
    seq = list(prompt)
    with torch.no_grad():
        for j in range(n):
            h, _ = d(torch.tensor([seq]))
            t = int(d.draft_vocab[d.logits(h[:, -1]).argmax(-1)])
            seq.append(t if j % every else (t + 1) % V)
    return seq[len(prompt):]


def _kernel(use):
    if not use:
        return None
    from vllm_spec_plugins import native
    k = native.mamba_step()
    if k is None:
        pytest.skip("no C compiler here")
    return k


def test_step_kernel_equals_torch_step_in_place_and_across_snapshots():
    """`step_into` (the C step, states read from and written to snapshot buffers) == `step` on
    gathered states, for rows that move to another snapshot and rows updated in place."""
    d = drafter()
    kernel = _kernel(True)
    torch.manual_seed(4)
    bufs = [(torch.randn(3, 4, L.conv_dim, L.K - 1), torch.randn(3, 4, L.H, L.P, L.N)) for L in d.layers]
    sl, src, dst = torch.tensor([2, 0, 1]), torch.tensor([1, 3, 2]), torch.tensor([1, 0, 3])
    with torch.no_grad():
        for ids in ([3, 7, 11], [8, 1, 250]):
            ids = torch.tensor(ids)
            want_h, want = d.step(ids, [(c[sl, src], s[sl, src]) for c, s in bufs])
            untouched = [(c[1, 0].clone(), s[1, 0].clone()) for c, s in bufs]
            got_h = d.step_into(ids, bufs, sl, src, dst, kernel)
            torch.testing.assert_close(got_h, want_h, rtol=1e-5, atol=1e-5)
            for (c, s), (wc, ws), (uc, us) in zip(bufs, want, untouched):
                torch.testing.assert_close(c[sl, dst], wc, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(s[sl, dst], ws, rtol=1e-5, atol=1e-5)
                assert torch.equal(c[1, 0], uc) and torch.equal(s[1, 0], us)   # other snapshots kept
            src = dst


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "c_step"])
def test_proposer_matches_replay_and_frees_state(kernel):
    d = drafter()
    d.step_kernel = _kernel(kernel)
    torch.manual_seed(1)
    prompts = {f"r{r}": torch.randint(0, V, (11 + 7 * r,)).tolist() for r in range(3)}
    answers = {r: _partly_predicted(d, p, 30, 3) for r, p in prompts.items()}
    prop = MambaProposer(4, d, max_requests=1)        # grows past one slot
    acc, steps = _run(prop, d, prompts, answers)
    for r in prompts:
        s, a = greedy_chain_accepted(d, prompts[r], answers[r], 4)
        assert (steps[r], acc[r]) == (s, a)
        assert a > 0
    assert len(prop.slots) == 3
    prop.propose(StepContext([], set(prompts), set(), 4))
    assert not prop.slots and len(prop.free) == prop.capacity


@pytest.mark.parametrize("dtype", [torch.bfloat16, "int8"])
def test_low_precision_matmuls_shrink_the_weights_and_keep_the_proposer_exact(dtype):
    """`matmuls_in`: projections and head in bf16 (half the bytes a drafted token reads) or int8
    (a quarter, plus one scale per row), states float32, outputs close to the float32 drafter's;
    the proposer still drafts exactly what that drafter predicts (snapshots, the last draft fed
    only when accepted), on the torch path and through the C step."""
    def nbytes(d):
        head = [d.head] if isinstance(d.head, torch.Tensor) else list(d.head.buffers())
        mods = [m for L in d.layers for m in (L.in_proj, L.out_proj)]
        return sum(t.nbytes for m in mods for t in [*m.parameters(), *m.buffers()]) + sum(t.nbytes for t in head)
    d32, dq = drafter(), drafter().matmuls_in(dtype)
    n_out = sum(m.weight.shape[0] for L in d32.layers for m in (L.in_proj, L.out_proj)) + d32.head.shape[0]
    assert nbytes(dq) == nbytes(d32) // 2 if dtype == torch.bfloat16 else nbytes(d32) // 4 + 2 * n_out
    ids = torch.randint(0, V, (1, 23))
    with torch.no_grad():
        (h32, _), (hq, sq) = d32(ids), dq(ids)
        assert hq.dtype == torch.float32 and all(t.dtype == torch.float32 for st in sq for t in st)
        lq, l32 = dq.logits(hq), d32.logits(h32)
        assert (lq - l32).abs().max() < 0.05 * l32.abs().max()      # bf16: 8 bits of mantissa; int8: 7
        assert (lq.argmax(-1) == l32.argmax(-1)).float().mean() > 0.8
    torch.manual_seed(3)
    prompts = {f"r{r}": torch.randint(0, V, (9 + r,)).tolist() for r in range(2)}
    answers = {r: _partly_predicted(dq, p, 24, 4) for r, p in prompts.items()}
    for kernel in (False, True):
        dq.step_kernel = _kernel(kernel)
        acc, steps = _run(MambaProposer(3, dq), dq, prompts, answers)
        for r in prompts:
            assert (steps[r], acc[r]) == greedy_chain_accepted(dq, prompts[r], answers[r], 3)
            assert acc[r] > 0


@pytest.mark.parametrize("fallback", [torch.bfloat16, torch.float32])
def test_int8_falls_back_where_torch_cannot_run_it(fallback):
    """Input widths that are not multiples of 32 (torch's int8 matmul gave NaN or crashed on
    some here) keep the `fallback` dtype (a float32 target's drafter keeps float32: bf16
    matmuls of a few rows run ~2.6x slower than float32 on an AVX2 host); the others become
    int8."""
    from vllm_spec_plugins.proposers.mamba import Int8Linear
    assert Int8Linear.of(torch.randn(8, 40)) is None and Int8Linear.of(torch.randn(8, 100)) is None
    assert isinstance(Int8Linear.of(torch.randn(8, 64)), Int8Linear)
    torch.manual_seed(0)
    emb = torch.randn(V, 48)       # d = 48: the in-projection and the head read 48 wide
    d = StateSpaceDrafter({"head_dim": 16, "d_state": 8, "chunk": 8}, emb, emb, torch.arange(0, V, 2)).eval()
    d.matmuls_in("int8", fallback)
    assert d.layers[0].in_proj.weight.dtype == fallback and d.head.dtype == fallback
    assert isinstance(d.layers[0].out_proj, Int8Linear)           # 96 wide: int8
    with torch.no_grad():
        h, _ = d(torch.randint(0, V, (1, 9)))
        assert torch.isfinite(d.logits(h)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_served_drafter_reads_int8_weights_under_either_target_dtype(dtype, tmp_path):
    """What the plugin loads for a served Mamba drafter: int8 projections and head whatever the
    target's dtype (the bytes a drafted token reads are its cost), a matrix int8 cannot run in
    the target's own dtype."""
    import json

    from safetensors.torch import save_file

    from vllm_spec_plugins.proposer import _drafter
    from vllm_spec_plugins.proposers.mamba import Int8Linear
    torch.manual_seed(0)
    emb = torch.randn(V, 64)                  # every matrix 64 or 128 wide: int8 runs them all
    target, folder = tmp_path / "target", tmp_path / "mamba"
    target.mkdir(), folder.mkdir()
    save_file({"model.embed_tokens.weight": emb}, str(target / "model.safetensors"))
    d = StateSpaceDrafter({"head_dim": 16, "d_state": 16, "chunk": 8}, emb, emb, torch.arange(0, V, 2))
    save_file({k: v.contiguous() for k, v in d.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(d.cfg))
    d = _drafter(str(folder), str(target), dtype)
    mats = [m for layer in d.layers for m in (layer.in_proj, layer.out_proj)] + [d.head]
    assert all(isinstance(m, Int8Linear) for m in mats)


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "c_step"])
def test_proposer_recovers_from_preemption_and_out_of_step_rows(kernel):
    d = drafter()
    d.step_kernel = _kernel(kernel)
    prop = MambaProposer(3, d)
    toks = np.array([5, 6, 7, 8])
    out1 = prop.propose(StepContext([RequestStep("a", toks, [8], [])], set(), set(), 3))[0]
    # preempted, then resumed with a longer history: recomputed, same drafts as a fresh proposer
    prop.propose(StepContext([], set(), {"a"}, 3))
    assert not prop.slots
    toks2 = np.array([5, 6, 7, 8, 9, 10])
    got = prop.propose(StepContext([RequestStep("a", toks2, [10], [])], set(), set(), 3))[0]
    want = MambaProposer(3, d).propose(StepContext([RequestStep("a", toks2, [10], [])], set(), set(), 3))[0]
    assert got == want and len(out1) == 3


def _topw_from_scratch(d, tokens, depth, w):
    """Per depth j: the drafter's top-w (tokens, probs) after tokens + its greedy chain[:j], each
    from one full pass over the sequence (no state reuse)."""
    seq, out = list(tokens), []
    with torch.no_grad():
        for _ in range(depth):
            h, _ = d(torch.tensor([seq]))
            p, t = torch.softmax(d.logits(h[:, -1]), -1).topk(w, -1)
            t = d.draft_vocab[t[0]].tolist()
            out.append((t, p[0].tolist()))
            seq.append(t[0])
    return out


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "c_step"])
def test_draft_tree_equals_scratch_after_siblings_skips_and_rejections(kernel):
    """bandit_tree's Mamba candidates: the spine is the drafter's greedy chain, each depth's
    siblings its next-best tokens under the spine node above, scores chain probabilities; after
    a sibling was accepted (fed from the snapshot where it left the spine), a step without drafts,
    or a rejection, the next tree equals a from-scratch run over the whole sequence."""
    d = drafter()
    d.step_kernel = _kernel(kernel)
    depth, w = 4, 3
    prop = MambaProposer(depth, d)
    rng = np.random.default_rng(0)
    toks = rng.integers(0, V, 9).tolist()
    drafts, sampled = [], [toks[-1]]
    plan = ["sibling", "skip", "reject", "spine", "sibling", "sibling", "reject"]
    for step, what in enumerate(plan + ["end"]):
        req = RequestStep("a", np.array(toks), sampled, drafts)
        rows = set() if what == "skip" else {0}
        cands = prop.draft_tree(StepContext([req], set(), set(), depth), rows, depth, w)
        if what == "skip":
            assert cands == {}
            drafts, sampled = [], [int(rng.integers(0, V))]
            toks.append(sampled[0])
            continue
        tokens, parents, scores = cands[0]
        want = _topw_from_scratch(d, toks, depth, w)
        reach, up = 1.0, -1
        for j, (wt, wp) in enumerate(want):
            got = slice(j * w, (j + 1) * w)
            assert tokens[got] == wt, f"step {step}, depth {j + 1}"
            assert parents[got] == [up] * w
            np.testing.assert_allclose(scores[got], [reach * q for q in wp], rtol=1e-4)
            reach, up = scores[j * w], j * w
        if what == "end":
            break
        spine = [x[0][0] for x in want]
        if what == "sibling":          # accepted: spine[:j], then the sibling at depth j+1
            j = int(rng.integers(0, depth))
            acc = spine[:j] + [want[j][0][1 + int(rng.integers(0, w - 1))]]
        elif what == "spine":
            acc = spine
        else:                          # reject at a random depth
            acc = spine[:int(rng.integers(0, depth))]
        bonus = int(rng.integers(0, V))
        drafts, sampled = tokens, acc + [bonus]
        toks += sampled
    assert prop.spine and prop.slots
    prop.draft_tree(StepContext([], {"a"}, set(), depth), set(), depth, w)
    prop.release("a")
    assert not prop.slots and not prop.spine and not prop.ntok


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "c_step"])
def test_ngram_lookup_drafting_alone_keeps_the_drafter_in_step(kernel):
    """While the drafter does not pay, `Goodput` has n-gram lookup draft alone
    (`propose_fallback`); with such steps in between, their drafts accepted, every chain the
    drafter hands out is still its greedy chain over the request's tokens from scratch."""
    from tests.test_proposers_cascade import greedy_chain
    d = drafter()
    d.step_kernel = _kernel(kernel)

    class Alternating(MambaProposer):
        calls, alone_tokens = 0, 0

        def propose(self, ctx):
            self.calls += 1
            if self.calls % 3:
                out = self.propose_fallback(ctx)
                for chain, cls in zip(out, self.classes):
                    assert len(cls) == len(chain) and all(self.ALONE <= c < len(self.class_prior) for c in cls)
                    self.alone_tokens += len(chain)
                return out
            out = super().propose(ctx)
            for req, chain in zip(ctx.requests, out):
                if chain:
                    assert chain == greedy_chain(self.d, req.token_ids, len(chain)), req.req_id
            return out

    torch.manual_seed(7)
    prompts, answers = {}, {}
    for r in range(3):
        p = torch.randint(0, V, (10,)).tolist()
        prompts[f"r{r}"] = p + p[:4]                       # repeats: the lookup drafts, the target accepts
        answers[f"r{r}"] = [t if j % 9 else (t + 1) % V for j, t in enumerate((p[4:] + p) * 4)][:48]
    prop = Alternating(4, d, max_requests=3)
    acc, _ = _run(prop, d, prompts, answers)
    assert prop.alone_tokens > 0 and sum(acc.values()) > 0
    prop.propose(StepContext([], set(prompts), set(), 4))
    assert not prop.slots and not prop.alone
