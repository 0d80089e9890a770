"""The cascade proposer alone (pure torch): what reaches the target is exactly the Mamba drafter's own
greedy chain, level-0 (n-gram) tokens are kept by the drafter's one-pass check, and snapshots let a
rejection resume without recomputation."""
import numpy as np
import pytest
import torch

from tests.test_proposers_mamba import V, _kernel, _run, drafter
from vllm_spec_plugins.proposers.base import RequestStep, StepContext
from vllm_spec_plugins.proposers.cascade import CascadeConfig, CascadeProposer

NGRAM = ["ngram", "mamba"]     # level 0: n-gram lookup in the request's own tokens


def greedy_chain(d, tokens, n):
    with torch.no_grad():
        h, st = d(torch.tensor([list(tokens)]))
        h, out = h[:, -1], []
        for _ in range(n):
            t = d.draft_vocab[d.logits(h).argmax(-1)]
            out.append(int(t))
            h, st = d.step(t, st)
    return out


class Checked(CascadeProposer):
    """Every chain handed out == the drafter's greedy chain from scratch over the same tokens."""
    def propose(self, ctx):
        out = super().propose(ctx)
        for req, chain in zip(ctx.requests, out):
            if chain:
                assert chain == greedy_chain(self.d, req.token_ids, len(chain)), req.req_id
        return out


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "c_step"])
def test_cascade_hands_out_the_drafters_greedy_chain_and_keeps_level0_tokens(kernel):
    d = drafter()
    d.step_kernel = _kernel(kernel)
    torch.manual_seed(3)
    prompts, answers = {}, {}
    for r in range(3):
        p = torch.randint(0, V, (9 + 5 * r,)).tolist()
        own = greedy_chain(d, p, 40)
        # every 7th token changed: rejections, so rollbacks to inner snapshots are exercised
        prompts[f"r{r}"], answers[f"r{r}"] = p, [t if j % 7 else (t + 1) % V for j, t in enumerate(own)]
    prop = Checked(CascadeConfig(8, model="", levels=NGRAM, drafter_steps=2, drafter_top_k=1), d, max_requests=1)
    acc, steps = _run(prop, d, prompts, answers)
    s = prop.stats
    assert sum(acc.values()) > 0
    assert s["level0_kept"] > 0 and s["target_accepted_level0"] > 0     # the n-gram level paid
    assert s["level0_kept"] <= s["level0_proposed"]
    assert s["target_accepted_level0"] + s["target_accepted_drafter"] <= sum(acc.values())
    # some chains are longer than the drafter's own sequential budget (1 + drafter_steps)
    assert s["drafter_tokens"] > s["steps"] * 3 or s["target_drafts_level0"] > 0
    prop.propose(StepContext([], set(prompts), set(), 8))
    assert not prop.mamba.slots and not prop.origin


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "c_step"])
def test_cascade_recovers_from_preemption_and_single_token_prompts(kernel):
    d = drafter()
    d.step_kernel = _kernel(kernel)
    prop = Checked(CascadeConfig(6, model="", levels=NGRAM, drafter_steps=3, drafter_top_k=1), d)
    prop.propose(StepContext([RequestStep("a", np.array([5]), [5], [])], set(), set(), 6))
    prop.propose(StepContext([], set(), {"a"}, 6))
    assert not prop.mamba.slots
    toks = np.array([5, 6, 7, 5, 6, 7, 5, 6])
    got = prop.propose(StepContext([RequestStep("a", toks, [6], [])], set(), set(), 6))[0]
    assert 4 <= len(got) <= 6


def test_drafter_top_k_keeps_more_level0_tokens():
    d = drafter()
    torch.manual_seed(5)
    prompts, answers = {}, {}
    for r in range(3):
        p = torch.randint(0, V, (12,)).tolist()
        p = p + p[:6]                                            # repeats: the n-gram level proposes
        prompts[f"r{r}"], answers[f"r{r}"] = p, (p[6:12] * 5)[:30]
    kept = {}
    for top_k in (1, 8):
        prop = CascadeProposer(CascadeConfig(8, model="", levels=NGRAM, drafter_steps=2, drafter_top_k=top_k), d)
        acc, _ = _run(prop, d, prompts, answers)
        kept[top_k] = (prop.stats["level0_kept"], prop.stats["target_accepted_level0"])
    assert kept[8][0] > kept[1][0] and kept[8][1] > kept[1][1], kept


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "c_step"])
def test_drafter_top_k_0_hands_the_whole_ngram_draft_on(kernel):
    d = drafter()
    d.step_kernel = _kernel(kernel)
    prop = CascadeProposer(CascadeConfig(8, model="", levels=NGRAM, drafter_steps=2, drafter_top_k=0), d)
    toks = np.array([5, 6, 7, 8, 9, 5, 6])                      # n-gram continuation of "5 6": 7 8 9 5 6
    out = prop.propose(StepContext([RequestStep("a", toks, [6], [])], set(), set(), 8))[0]
    assert out[:5] == [7, 8, 9, 5, 6] and len(out) == 8
    want = greedy_chain(d, list(toks) + out[:5], 3)            # then the drafter's own chain from there
    assert out[5:] == want


def test_lookahead_level_drafts_from_the_targets_outputs_and_the_shared_pool():
    """Level 0 = lookahead's chain form: an n-gram the target produced at a rejected position
    (its Jacobi pool) and text another request wrote (the shared pool) reach the target, where
    n-gram lookup in the request's own tokens has nothing."""
    from vllm_spec_plugins.proposers.lookahead import LookaheadConfig, LookaheadProposer
    d = drafter()
    la = LookaheadProposer(LookaheadConfig(8, ngram=2, shared_pool=1024))
    prop = CascadeProposer(CascadeConfig(8, model="", levels=["lookahead", "mamba"], drafter_steps=2,
                                          drafter_top_k=0), d, level0=la)
    assert prop.needs_target_argmax
    ctx = lambda *reqs: StepContext(list(reqs), set(), set(), 8)
    toks = [20, 21, 22]
    x = prop.propose(ctx(RequestStep("a", np.array(toks), [22], [])))[0]
    # the target rejects x[0], emits 30, and after x[0] it would have emitted 31
    toks += [30]
    y = prop.propose(ctx(RequestStep("a", np.array(toks), [30], x, target_argmax=[30] + [31] * len(x))))[0]
    assert (x[0], 31) in la.states["a"].pool.get(x[0])
    # next: nothing of y accepted, the target emits x[0]: level 0 continues it with 31
    assert y[0] != x[0]
    toks += [x[0]]
    z = prop.propose(ctx(RequestStep("a", np.array(toks), [x[0]], y, target_argmax=[x[0]] + [31] * len(y))))[0]
    assert z[0] == 31 and 31 not in toks
    # another request ending in "21 22" gets a's continuation from the shared pool
    prop.propose(StepContext([], {"a"}, set(), 8))
    assert "a" not in la.states and not prop.mamba.slots
    w = prop.propose(ctx(RequestStep("b", np.array([40, 21, 22]), [22], [])))[0]
    assert w[:2] == [30, x[0]], w
    plain = CascadeProposer(CascadeConfig(8, model="", levels=NGRAM, drafter_steps=2, drafter_top_k=0), d)
    assert plain.propose(ctx(RequestStep("b", np.array([40, 21, 22]), [22], [])))[0][:2] != [30, x[0]]


@pytest.mark.parametrize("kernel", [False, True], ids=["torch", "c_step"])
@pytest.mark.parametrize("level0", ["ngram", "lookahead"])
def test_level0_drafting_alone_keeps_the_drafter_in_step(kernel, level0):
    """While the drafter does not pay, `Goodput` has level 0 draft alone (`propose_fallback`);
    steps of either kind, in any order, with level 0's drafts accepted in between: every chain the
    drafter hands out afterwards is still its greedy chain over the request's tokens from scratch,
    and level 0's tokens alone carry classes of their own."""
    from vllm_spec_plugins.proposers.lookahead import LookaheadConfig, LookaheadProposer
    d = drafter()
    d.step_kernel = _kernel(kernel)
    levels = [level0, "mamba"]
    la = LookaheadProposer(LookaheadConfig(8, ngram=2, shared_pool=0)) if level0 == "lookahead" else None

    class Alternating(Checked):
        calls, alone_tokens = 0, 0

        def propose(self, ctx):
            self.calls += 1
            if self.calls % 3 == 0:
                return super().propose(ctx)
            out = self.propose_fallback(ctx)
            for chain, cls in zip(out, self.classes):
                assert len(cls) == len(chain) and all(self.ALONE <= c < len(self.class_prior) for c in cls)
                self.alone_tokens += len(chain)
            return out

    torch.manual_seed(7)
    prompts, answers = {}, {}
    for r in range(3):
        p = torch.randint(0, V, (10,)).tolist()
        prompts[f"r{r}"] = p + p[:4]                       # repeats: level 0 drafts, the target accepts
        answers[f"r{r}"] = [t if j % 9 else (t + 1) % V for j, t in enumerate((p[4:] + p) * 4)][:48]
    prop = Alternating(CascadeConfig(6, model="", levels=levels, drafter_steps=2, drafter_top_k=1), d,
                       max_requests=3, level0=la)
    acc, _ = _run(prop, d, prompts, answers)
    s = prop.stats
    assert prop.alone_tokens > 0 and s["target_accepted_level0"] > 0 and s["target_drafts_drafter"] > 0
    prop.propose(StepContext([], set(prompts), set(), 6))
    assert not prop.mamba.slots and not prop.mamba.alone
