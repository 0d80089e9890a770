"""Lookahead (Jacobi + n-gram pool) proposer, the toy engine / simulate harness, oracle and
adversarial proposers. Pure python/numpy, no vLLM."""
import random

import numpy as np
import pytest

from vllm_spec_plugins.proposers.base import Proposer, RequestStep, ngram_lookup
from vllm_spec_plugins.proposers.lookahead import LookaheadConfig, LookaheadProposer, NGramPool, SharedPool
from vllm_spec_plugins.proposers.testing import AdversarialProposer, OracleProposer, ToyEngine, greedy, simulate


class PromptLookup(Proposer):
    """Baseline: prompt lookup only (base.ngram_lookup)."""

    def propose_one(self, state, req, k):
        return ngram_lookup(req.token_ids, k, 1, 3)


def fib(V):
    """next = f(last two) mod V: periodic (Pisano period 300 for V=50), so the text repeats."""
    return lambda t: (t[-1] + t[-2]) % V


def lcg(V=1024, a=5, c=3):
    """next = f(last token), a single cycle of length V: the text never repeats within V tokens."""
    return lambda t: (a * t[-1] + c) % V


def lcg_case(seed=0):
    """f(last) target whose prompt holds tokens from the text's future, in shuffled order: prompt
    lookup proposes the prompt's (wrong) successor, Jacobi iterates each seed into its true orbit."""
    f = lcg()
    orbit = [7]
    for _ in range(600):
        orbit.append(f(orbit[-1:]))
    seeds = [orbit[d] for d in range(8, 400, 8)]
    random.Random(seed).shuffle(seeds)
    return f, seeds + [orbit[0]]


def tau(out, steps):
    return len(out) / steps


# ---------------------------------------------------------------------------------------------
# pool
# ---------------------------------------------------------------------------------------------


def test_pool_dedup_per_key_and_lru():
    pool = NGramPool(3, cap=4, per_key=2)
    pool.add((1, 2, 3))
    pool.add((1, 2, 3))
    assert pool.size() == 1
    pool.add((1, 4, 5))
    pool.add((1, 2, 3))           # refresh: (1, 4, 5) is now the oldest for key 1
    pool.add((1, 6, 7))           # per-key bound evicts (1, 4, 5)
    assert pool.get(1) == [(1, 2, 3), (1, 6, 7)]
    for g in [(2, 0, 0), (3, 0, 0), (4, 0, 0)]:
        pool.add(g)               # global bound evicts the oldest: (1, 2, 3), then (1, 6, 7)
    assert pool.size() == 4 and pool.get(1) == [(1, 6, 7)]
    pool.add((5, 0, 0))
    assert pool.get(1) == [] and pool.size() == 4


def test_pool_cap_holds_over_4000_tokens():
    V, cap = 997, 256
    f = lambda t: (3 * t[-1] + 7 * t[-2] + 11) % V   # long period: a steady stream of new n-grams
    p = LookaheadProposer(LookaheadConfig(8, ngram=4, guesses=4, pool_cap=cap), vocab_size=V)
    eng = ToyEngine(p, f, vocab_size=V)
    eng.add("r", [1, 2, 3], 4000)
    sizes, nbytes = [], []
    while eng.reqs:
        eng.step()
        st = p.states.get("r")
        if st is not None:
            sizes.append(st.pool.size())
            if len(sizes) % 100 == 0:
                nbytes.append(st.pool.nbytes())
    assert len(eng.done["r"].out) == 4000
    assert max(sizes) == cap                      # saturated, never above
    # ~350 B per n-gram on CPython 3.11 (tuples + LRU dict + per-key lists; token ints shared)
    assert max(nbytes) <= cap * 512
    saturated = nbytes[sizes.index(cap) // 100 + 1:]
    assert max(saturated) <= 1.5 * min(saturated)  # flat once full, not growing with the text
    assert "r" not in p.states                    # released when it finished


def test_shared_pool_counts_and_bounds():
    sp = SharedPool(3, cap=100, per_key=2)
    sp.add([1, 2, 3, 1, 2, 4, 1, 2, 3], 0)
    assert sp.best([9, 1, 2], 1, 2)[0] == 3           # (1, 2) -> 3 twice, 4 once
    assert sp.best([9, 9, 2], 1, 2)[0] == 3           # (2,) -> 3 twice
    assert sp.best([9, 9, 3], 1, 2)[0] == 1
    assert sp.best([7, 8], 1, 2) is None
    assert sp.best([8, 3], 2, 2) is None           # (8, 3) unseen, 1-token context not allowed
    sp.add([0, 2, 5], 1)                           # (2,) now holds 3, 4, 5: the least counted, oldest goes
    assert sp.best([2], 1, 1)[0] == 3 and sorted(sp._tab[(2,)]) == [3, 5]
    sp.add([0, 2, 5], 1)
    sp.add([0, 2, 5], 1)
    assert sp.best([2], 1, 1)[0] == 5                 # 5 three times against 3 twice
    sp = SharedPool(2, cap=3)
    sp.add([1, 2, 3, 4, 5], 0)                     # contexts (1,) .. (4,): the oldest went
    assert list(sp._tab) == [(2,), (3,), (4,)]
    sp.add([2, 9], 1)                              # (2,) extended: now the most recent
    sp.add([6, 7], 1)
    assert list(sp._tab) == [(4,), (2,), (6,)] and len(sp) == 3


def test_shared_pool_carries_text_across_requests():
    """Request b's prompt is 3 tokens of request a's output: with the shared pool b drafts a's
    text (tau >> 1), without it b's own text has nothing to copy. Output == greedy either way."""
    V = 997
    f = lambda t: (3 * t[-1] + 7 * t[-2] + 11) % V   # next = f(last two): b continues a's text
    a = greedy(f, [1, 2, 3], 400)
    taus = {}
    for cap in (0, 4096):
        p = LookaheadProposer(LookaheadConfig(8, ngram=4, shared_pool=cap), vocab_size=V)
        out_a, _, _ = simulate(p, f, [1, 2, 3], 400, req_id="a", vocab_size=V)
        out_b, steps, _ = simulate(p, f, a[100:103], 200, req_id="b", vocab_size=V)
        assert out_a == a and out_b == greedy(f, a[100:103], 200) and not p.states
        taus[cap] = tau(out_b, steps)
    assert taus[0] < 1.5 and taus[4096] > 4.0


def test_shared_pool_keeps_tenants_apart():
    """Requests with another `cache_salt` (tenant) never draft from a's text: b of tenant "y" drafts
    as with no shared pool; b of a's tenant "x" drafts a's text. Output == greedy in every case."""
    V = 997
    f = lambda t: (3 * t[-1] + 7 * t[-2] + 11) % V
    a = greedy(f, [1, 2, 3], 400)

    def run(cap, tenant_a, tenant_b):
        p = LookaheadProposer(LookaheadConfig(8, ngram=4, shared_pool=cap), vocab_size=V)
        for rid, prompt, n, tenant in (("a", [1, 2, 3], 400, tenant_a), ("b", a[100:103], 200, tenant_b)):
            eng = ToyEngine(p, f, vocab_size=V)
            eng.add(rid, prompt, n, tenant=tenant)
            while eng.reqs:
                eng.step()
            eng.flush()
            assert eng.done[rid].out == greedy(f, prompt, n)
        return tau(eng.done["b"].out, eng.done["b"].steps), p
    alone, _ = run(0, "x", "y")
    other, p = run(4096, "x", "y")
    same, _ = run(4096, "x", "x")
    default_tenant, _ = run(4096, None, None)
    assert other == alone < 1.5 and same > 4.0 and default_tenant > 4.0
    assert {k[0] for k in p.shared._tab} == {"x", "y"}      # every context keyed by its tenant


def test_shared_pool_takes_a_preempted_requests_text_once():
    """A preempted request resumes with a fresh per-request state; the shared pool must not count
    its text again: the table after a run with two preemptions == the table after one without."""
    V = 997
    f = lambda t: (3 * t[-1] + 7 * t[-2] + 11) % V
    tabs = []
    for preempt_at in ((), (5, 12)):
        p = LookaheadProposer(LookaheadConfig(6, ngram=4, shared_pool=4096), vocab_size=V)
        eng = ToyEngine(p, f, vocab_size=V)
        eng.add("r", [1, 2, 3], 120)
        steps = 0
        while eng.reqs or eng.paused:
            if steps in preempt_at and "r" in eng.reqs:
                eng.preempt("r")
                eng.step()                     # reports the preemption; r has no row
                eng.resume("r")
            eng.step()
            steps += 1
        eng.flush()
        assert eng.done["r"].out == greedy(f, [1, 2, 3], 120)
        tabs.append({k: dict(v) for k, v in p.shared._tab.items()})
    assert tabs[0] == tabs[1]


def test_shared_pool_cap_holds_over_4000_tokens():
    V, cap = 997, 256
    f = lambda t: (3 * t[-1] + 7 * t[-2] + 11) % V
    p = LookaheadProposer(LookaheadConfig(8, ngram=4, shared_pool=cap), vocab_size=V)
    eng = ToyEngine(p, f, vocab_size=V)
    eng.add("r", [1, 2, 3], 4000)
    sizes, nbytes = [], []
    while eng.reqs:
        eng.step()
        sizes.append(len(p.shared))
        if len(sizes) % 100 == 0:
            nbytes.append(p.shared.nbytes())
    assert len(eng.done["r"].out) == 4000 and eng.done["r"].out == greedy(f, [1, 2, 3], 4000)
    assert max(sizes) == cap
    saturated = nbytes[sizes.index(cap) // 100 + 1:]
    assert saturated and max(saturated) <= 1.5 * min(saturated)


# ---------------------------------------------------------------------------------------------
# lookahead behaviour
# ---------------------------------------------------------------------------------------------


def test_incremental_prompt_lookup_matches_ngram_lookup():
    rng = np.random.default_rng(0)
    t = rng.integers(0, 6, 400)
    p = LookaheadProposer(LookaheadConfig(5))
    st = p.new_state(RequestStep("r", t[:1], [], []))
    for L in range(2, len(t)):
        p._index_text(st, t[:L], "r")
        got, _ = p._lookup(st, t[:L], t[max(L - 3, 0):L].tolist(), 5, 1)
        assert got == ngram_lookup(t[:L], 5, 1, 3), L


def test_a_text_match_drafts_the_longest_matchs_most_frequent_continuation():
    """As suffix decoding: of the occurrences of the last 3 tokens, those that agree with the text
    over the most tokens, and among them the continuation most of them take, token by token
    (ties: the latest occurrence's). A brute force over the text agrees at every length."""
    p = LookaheadProposer(LookaheadConfig(4, shared_pool=0))

    def draft(text):
        t = np.array(text)
        st = p.new_state(RequestStep("r", t, [], []))
        p._index_text(st, t, "r")
        return p.classed_chain(st, t, 4)[0]

    # the latest "1 2 3" agrees over 3 tokens, an older one over 4 ("9 1 2 3"): the older one's
    # continuation
    assert draft([9, 1, 2, 3, 40, 41, 8, 1, 2, 3, 50, 51, 9, 1, 2, 3])[:2] == [40, 41]
    # all three agree over 3 tokens: two go on with 40, then 41 and 42 tie: the latest, 42
    assert draft([7, 1, 2, 3, 40, 41, 6, 1, 2, 3, 40, 42, 5, 1, 2, 3, 50, 51, 4, 1, 2, 3])[:2] == [40, 42]

    def brute(text, r):
        """Over the latest `OCCURRENCES` occurrences of the last 3 tokens."""
        occ = [pos for pos in range(3, len(text)) if text[pos - 3:pos] == text[-3:]][-p.OCCURRENCES:]
        agree = {}
        for pos in occ:
            n = 3
            while n < min(pos, p.MATCH_DEPTH) and text[pos - n - 1] == text[-n - 1]:
                n += 1
            agree[pos] = n
        conts = [text[pos:pos + r] for pos in occ if agree[pos] == max(agree.values())]
        out = []
        for j in range(r):
            votes = [c[j] for c in conts if len(c) > j and c[:j] == out]
            if not votes:
                break
            out.append(max(reversed(votes), key=votes.count))
        return out

    rng = np.random.default_rng(1)
    checked = 0
    for _ in range(300):
        text = rng.integers(0, 3, int(rng.integers(8, 80))).tolist()
        t = np.array(text)
        st = p.new_state(RequestStep("r", t, [], []))
        p._index_text(st, t, "r")
        got, _ = p._lookup(st, t, text[-3:], 4, 3, text[-p.MATCH_DEPTH:])
        assert got == brute(text, 4), text
        checked += bool(got)
    assert checked > 100


def test_a_text_match_is_classed_by_how_far_it_agrees():
    """A chain copied from where the text agrees with the context over `LONG_MATCH` tokens or more
    carries source 5's classes (`Goodput` learns a rate for it: suffix decoding's match length,
    as a class). One where it agrees over 2 is copied as far, its 2 tokens in source 0's classes
    and those past them in source 6's, priced at their own rate. A cascade's level 0 copies
    both alike."""
    p = LookaheadProposer(LookaheadConfig(4, shared_pool=0))
    long_ = list(range(10, 30))                       # 20 distinct tokens, repeated: agreement >= 8
    short = [1, 2, 3, 4, 5, 6, 7, 8, 9, 40, 41, 42, 43, 50, 51, 52, 53, 54, 55, 56, 57, 42, 43]   # 42 43: 2 agree
    D = p._DEPTHS
    for text, sources in ((long_ + [0] + long_[:12], [5, 5, 5, 5]), (short, [0, 0, 6, 6])):
        t = np.array(text)
        st = p.new_state(RequestStep("r", t, [int(t[-1])], []))
        p.observe(st, RequestStep("r", t, [int(t[-1])], []))
        p._classes = []
        drafts = p.propose_one(st, RequestStep("r", t, [int(t[-1])], []), 4)
        copied = text[text.index(text[-1]) + 1:][:4]
        assert drafts == copied, (sources, drafts)
        assert p._classes == [(2 * src + (j > 0)) * D + j for j, src in enumerate(sources)], p._classes
        assert p.chain(st, t, 4) == copied
        p.release("r")


@pytest.mark.parametrize("ngram", [2, 3, 4, 5])
def test_jacobi_ngrams_are_aligned(ngram):
    # With a target that only looks at the last token, every genuine "token -> target's next
    # token" link is correct whatever came before, so a misaligned harvest shows up as a pool
    # n-gram that breaks f. Acceptances (window shifts) happen along the way.
    f, prompt = lcg_case()
    p = LookaheadProposer(LookaheadConfig(6, ngram=ngram, window=5))
    eng = ToyEngine(p, f)
    eng.add("r", prompt, 150)
    seeds = set(prompt)
    checked = 0
    while eng.reqs:
        eng.step()
        st = p.states.get("r")
        for g in (st.pool._lru if st else ()):
            if g[0] in seeds and g[:2] == tuple(prompt[prompt.index(g[0]):][:2]):
                continue                    # an n-gram of the (shuffled) prompt text itself
            assert all(f(g[i:i + 1]) == g[i + 1] for i in range(ngram - 1)), g
            checked += 1
    assert sum(eng.done["r"].accepted) > 20 and checked > 100


def test_recurrence_target_tau_and_lossless():
    f = fib(50)
    ref = greedy(f, [1, 1], 1000)
    for k in (4, 8):
        out, steps, acc = simulate(LookaheadProposer(LookaheadConfig(k)), f, [1, 1], 1000, vocab_size=50)
        assert out == ref
        assert tau(out, steps) > 2.0
        assert len(acc) == steps - 1 and sum(acc[:-1]) + steps - 1 < len(out) <= sum(acc) + steps


def test_jacobi_ngrams_beat_prompt_lookup_on_non_repeating_text():
    f, prompt = lcg_case()
    ref = greedy(f, prompt, 300)
    assert len(set(ref)) == 300             # no token (hence no n-gram) of the output repeats

    out, steps, _ = simulate(PromptLookup(8), f, prompt, 300)
    assert out == ref and tau(out, steps) < 1.05

    out, steps, _ = simulate(LookaheadProposer(LookaheadConfig(8, ngram=3)), f, prompt, 300)
    assert out == ref and tau(out, steps) > 2.0

    # same proposer, engine without target argmax: no Jacobi n-grams -> no gain
    eng = ToyEngine(LookaheadProposer(LookaheadConfig(8, ngram=3)), f, collect_argmax=False)
    eng.add("r", prompt, 300)
    while eng.reqs:
        eng.step()
    r = eng.done["r"]
    assert r.out == ref and tau(r.out, r.steps) < 1.1


def test_bounds_and_determinism():
    V = 37
    f = lambda t: (t[-1] * 7 + t[-2] * 3 + len(t) % 5) % V
    runs = []
    for _ in range(2):
        p = LookaheadProposer(LookaheadConfig(5, window=3, ngram=3, guesses=2, pool_cap=64), vocab_size=V)
        eng = ToyEngine(p, f, vocab_size=V)      # asserts len(drafts) <= k and 0 <= token < V
        eng.add("r", [1, 2, 3, 4], 300)
        drafts = []
        while eng.reqs:
            drafts.append(eng.step())
        runs.append(drafts)
        assert eng.done["r"].out == greedy(f, [1, 2, 3, 4], 300)
    assert runs[0] == runs[1]
    # k shrinking per step (engine budget): never more than the step's k
    p = LookaheadProposer(LookaheadConfig(6))
    eng = ToyEngine(p, fib(50), k=2)
    eng.add("r", [1, 1], 200)
    while eng.reqs:
        assert all(len(d) <= 2 for d in eng.step())


def test_vocab_filter():
    prompt = [1, 50, 51, 1, 50, 51, 1]               # prompt holds out-of-vocab tokens
    eng = ToyEngine(LookaheadProposer(LookaheadConfig(4)), lambda t: 1)
    eng.add("r", prompt, 5)
    assert 50 in eng.step()[0]                        # prompt lookup would draft them...
    eng = ToyEngine(LookaheadProposer(LookaheadConfig(4), vocab_size=10), lambda t: 1, vocab_size=10)
    eng.add("r", prompt, 5)
    while eng.reqs:
        eng.step()                                    # ...the engine asserts 0 <= draft < 10


# ---------------------------------------------------------------------------------------------
# per-request state
# ---------------------------------------------------------------------------------------------


# Isolation tests turn the shared pool off: it shares text across requests by design (its own
# tests below check its tenant and preemption rules).
def _solo(prompt, steps, f):
    p = LookaheadProposer(LookaheadConfig(4, ngram=3, shared_pool=0))
    eng = ToyEngine(p, f)
    eng.add("x", prompt, 10_000)
    return [eng.step()[0] for _ in range(steps)]


def test_state_isolation_reorder_finish_preempt():
    f = fib(50)
    pa, pb, pc = [1, 1], [3, 7], [2, 9]
    solo_a, solo_b = _solo(pa, 40, f), _solo(pb, 120, f)
    p = LookaheadProposer(LookaheadConfig(4, ngram=3, shared_pool=0))
    eng = ToyEngine(p, f)
    eng.add("a", pa, 10_000)
    eng.add("b", pb, 10_000)
    eng.add("c", pc, 10_000)
    got = {"a": [], "b": []}
    for step in range(120):
        if step == 40:
            eng.abort("a")
        if step == 60:
            eng.preempt("c")
        if step == 80:
            eng.resume("c")
        order = list(eng.reqs)[::(-1) ** step]              # rows reordered every step
        for rid, d in zip(order, eng.step(order)):
            got.setdefault(rid, []).append(d)
        if step == 40:
            assert "a" not in p.states and set(p.states) == {"b", "c"}
        if step == 60:
            assert "c" not in p.states and set(p.states) == {"b"}
        if step == 80:
            assert set(p.states) == {"b", "c"}              # fresh state for the resumed request
    assert got["a"] == solo_a
    assert got["b"] == solo_b                               # unaffected by a, c, reordering
    c = eng.reqs["c"]
    assert c.out == greedy(f, pc, len(c.out))


# ---------------------------------------------------------------------------------------------
# oracle / adversarial / validation
# ---------------------------------------------------------------------------------------------


def test_oracle_full_and_adversarial_zero_acceptance():
    f, prompt, n, k = fib(50), [4, 9], 200, 5
    ref = greedy(f, prompt, n)
    for refs in ({"sim": ref}, {tuple(prompt): ref}):
        out, steps, acc = simulate(OracleProposer(k, refs), f, prompt, n)
        assert out == ref
        assert all(a == k for a in acc[:-1]) and steps == 1 + -(-(n - 1) // (k + 1))
    out, steps, acc = simulate(AdversarialProposer(k, {tuple(prompt): ref}, vocab_size=50), f, prompt, n,
                               vocab_size=50)
    assert out == ref and steps == n and acc == [0] * (n - 1)


def test_oracle_matches_prompt_prefix_and_resume():
    f = fib(50)
    pa, pb = [1, 2], [1, 2, 3]            # one prompt is a prefix of the other: longest wins
    refs = {tuple(pa): greedy(f, pa, 60), tuple(pb): greedy(f, pb, 60)}
    p = OracleProposer(3, refs)
    eng = ToyEngine(p, f)
    eng.add("a", pa, 60)
    eng.add("b", pb, 60)
    for i in range(6):
        if i == 2:
            eng.preempt("b")
        if i == 3:
            eng.resume("b")
        eng.step()
    assert [len(x) for x in eng.step()] == [3, 3]
    while eng.reqs:
        eng.step()
    assert eng.done["a"].out == refs[tuple(pa)] and eng.done["b"].out == refs[tuple(pb)]
    assert all(a == 3 for a in eng.done["a"].accepted[:-1])


@pytest.mark.parametrize("kwargs, field", [
    (dict(window=-1), "window"), (dict(window=5), "window"),
    (dict(ngram=1), "ngram"), (dict(ngram=6), "ngram"),
    (dict(guesses=0), "guesses"), (dict(pool_cap=0), "pool_cap"),
    (dict(guesses=20, pool_cap=16), "guesses"),
    (dict(prompt_lookup_min=0), "prompt_lookup_min"),
    (dict(prompt_lookup_min=4, prompt_lookup_max=3), "prompt_lookup_min"),
    (dict(prompt_lookup_max=-1), "prompt_lookup_max"),
    (dict(window=2.5), "window"), (dict(shared_pool=-1), "shared_pool"),
    (dict(tree="yes"), "tree"), (dict(tree=True, tree_nodes=5), "tree_nodes"),
    (dict(tree=True, tree_nodes=-1), "tree_nodes"), (dict(num_speculative_tokens=0), "num_speculative_tokens"),
])
def test_range_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LookaheadConfig(**{"num_speculative_tokens": 4, **kwargs})


def test_valid_edge_configs():
    for tree in (False, True):
        p = LookaheadProposer(LookaheadConfig(1, window=1, ngram=2, guesses=1, pool_cap=16, prompt_lookup_max=1,
                                              tree=tree, tree_nodes=1))
        out, _, _ = simulate(p, fib(50), [1, 1], 100)
        assert out == greedy(fib(50), [1, 1], 100)
    with pytest.raises(ValueError, match="vocab_size"):
        LookaheadProposer(LookaheadConfig(4), vocab_size=0)


def test_served_defaults_are_the_config_defaults():
    """What a test builds from `LookaheadConfig()` is what `{"method": "lookahead"}` serves."""
    from vllm_spec_plugins.config import validate
    assert validate({"method": "lookahead"}) == LookaheadConfig()
    p = LookaheadProposer(LookaheadConfig())
    assert (p.k, p.window, p.ngram, p.guesses, p.shared.cap) == (16, 16, 4, 7, 65536)


# ---------------------------------------------------------------------------------------------
# tree form (full lookahead: verification branch + Jacobi window in one draft tree)
# ---------------------------------------------------------------------------------------------

from vllm_spec_plugins.proposers.testing import OracleTreeProposer, TreeToyEngine, pair_table_target, simulate_tree  # noqa: E402
from vllm_spec_plugins.scorers import DraftTree  # noqa: E402


def _tree_key(d):
    return (tuple(d.tokens), tuple(d.parents)) if hasattr(d, "parents") else tuple(d)


class _Spy(LookaheadProposer):
    """Checks every RequestStep the tree engine reports against the target, then proposes."""

    def __init__(self, f, *a, **kw):
        super().__init__(*a, **kw)
        self.f, self.checked = f, 0

    def observe(self, st, req):
        if req.tree_parents is not None:
            d, P, A = req.drafts, req.tree_parents, req.target_argmax
            assert len(P) == len(d) and len(A) == len(d) + 1
            prefix = tuple(req.token_ids[:len(req.token_ids) - len(req.sampled)].tolist())
            paths = []
            for x, p in zip(d, P):
                paths.append((paths[p] if p >= 0 else ()) + (x,))
            assert A[0] == self.f(prefix) and all(A[1 + i] == self.f(prefix + pt) for i, pt in enumerate(paths))
            acc = req.accepted_nodes
            assert acc == sorted(acc) and all(P[b] == a for a, b in zip([-1] + acc, acc))  # a root path
            assert req.sampled == [d[i] for i in acc] + [A[acc[-1] + 1 if acc else 0]]
            assert req.num_accepted == len(acc)
            self.checked += 1
        super().observe(st, req)


def test_tree_engine_reports_and_oracle_tree():
    f = fib(50)
    p = _Spy(f, LookaheadConfig(8, window=6, ngram=3, tree=True))
    eng = TreeToyEngine(p, f, vocab_size=50)
    eng.add("r", [1, 1], 300)
    while eng.reqs:
        eng.step()
    assert eng.done["r"].out == greedy(f, [1, 1], 300) and p.checked > 50 and eng.tree_steps > 50
    # a hidden true branch of depth 3 in random 8-node trees is accepted whole every step (a
    # random distractor below it may happen to be right too); an adversarial tree never
    ref = greedy(f, [4, 9], 200)
    out, steps, acc = simulate_tree(OracleTreeProposer(8, {tuple([4, 9]): ref}, 8, 3, vocab_size=50), f, [4, 9], 200)
    assert out == ref and all(a >= 3 for a in acc[:-1])
    out, steps, acc = simulate_tree(OracleTreeProposer(8, {tuple([4, 9]): ref}, 8, 3, vocab_size=50,
                                                       adversarial=True), f, [4, 9], 200)
    assert out == ref and sum(acc) == 0


TREE_CFGS = [dict(k=4, window=4, ngram=3, guesses=4, tree_nodes=4),
             dict(k=8, window=4, ngram=4, guesses=8, tree_nodes=6),
             dict(k=8, window=8, ngram=2, guesses=2, tree_nodes=8),
             dict(k=6, window=1, ngram=5, guesses=7, tree_nodes=3)]


@pytest.mark.parametrize("cfg", TREE_CFGS)
def test_tree_drafts_bounded_valid_lossless(cfg):
    cfg = dict(cfg)
    k, tn = cfg.pop("k"), cfg["tree_nodes"]
    lf, lprompt = lcg_case()
    for f, prompt, V, n in [(fib(50), [3, 7], 50, 250), (lf, lprompt, 1024, 150),
                            (pair_table_target(50, 1, 0.1), list(range(20)), 50, 200)]:
        p = LookaheadProposer(LookaheadConfig(k, tree=True, **cfg), vocab_size=V)
        eng = TreeToyEngine(p, f, vocab_size=V, max_tree_nodes=tn)   # asserts <= k, <= tn, in vocab
        eng.add("r", prompt, n)
        while eng.reqs:
            for d in eng.step():
                assert isinstance(d, (DraftTree, list))
                if isinstance(d, DraftTree):
                    assert 0 < len(d) <= tn
                    DraftTree(d.tokens, d.parents)                 # topological, parents < i
                    sib = [(p_, x) for x, p_ in zip(d.tokens, d.parents)]
                    assert len(set(sib)) == len(sib)               # a trie: no duplicate siblings
        assert eng.done["r"].out == greedy(f, prompt, n)
        assert eng.tree_steps > 0 and max(eng.proposed_sizes) <= tn


def test_tree_k_shrinks_and_tree_nodes_default():
    p = LookaheadProposer(LookaheadConfig(6, tree=True))
    assert p.tree_nodes == 6 and LookaheadProposer(LookaheadConfig(6, tree=True, tree_nodes=0)).tree_nodes == 6
    eng = TreeToyEngine(p, fib(50), k=2)       # the engine's per-step budget is below tree_nodes
    eng.add("r", [1, 1], 100)
    while eng.reqs:
        assert all(len(d) <= 2 for d in eng.step())


def test_tree_false_and_chain_only_requests_keep_chain_behaviour():
    f, prompt = fib(50), [2, 9]
    runs = []
    for kw, tree_ok in [({}, True), (dict(tree=False), True), (dict(tree=True), False)]:
        eng = TreeToyEngine(LookaheadProposer(LookaheadConfig(5, window=4, ngram=3, **kw)), f, tree_ok=tree_ok)
        eng.add("r", prompt, 200)
        drafts = []
        while eng.reqs:
            drafts += [list(d) for d in eng.step()]          # all chains (lists)
        runs.append(drafts)
        assert eng.tree_steps == 0
    eng = ToyEngine(LookaheadProposer(LookaheadConfig(5, window=4, ngram=3)), f)   # the original chain engine
    eng.add("r", prompt, 200)
    drafts = []
    while eng.reqs:
        drafts += eng.step()
    assert runs[0] == runs[1] == runs[2] == drafts
    # mixed batch: a chain-only request next to tree requests gets chains, the others trees
    p = LookaheadProposer(LookaheadConfig(6, tree=True))
    eng = TreeToyEngine(p, f, tree_ok=lambda rid: rid != "chain")
    for rid in ("a", "chain", "b"):
        eng.add(rid, prompt, 100)
    for _ in range(5):
        order = list(eng.reqs)
        for rid, d in zip(order, eng.step(order)):
            assert isinstance(d, list) if rid == "chain" else isinstance(d, DraftTree)


def test_tree_truncated_by_scheduler_and_cut_to_chain():
    # the scheduler keeps a prefix of the nodes (sometimes a chain, sometimes nothing)
    for f, prompt, V in [(fib(50), [1, 1], 50), (pair_table_target(50, 2, 0.1), list(range(16)), 50)]:
        rnd = random.Random(0)
        p = LookaheadProposer(LookaheadConfig(8, window=6, ngram=3, tree=True), vocab_size=V)
        eng = TreeToyEngine(p, f, vocab_size=V, truncate=lambda rid, n: rnd.randint(0, n))
        eng.add("r", prompt, 300)
        while eng.reqs:
            eng.step()
        assert eng.done["r"].out == greedy(f, prompt, 300) and eng.tree_steps > 10


@pytest.mark.parametrize("window_at", ["chain", "root", "both"])
@pytest.mark.parametrize("ngram", [2, 3, 4])
def test_tree_ngrams_are_genuine(ngram, window_at):
    # As test_jacobi_ngrams_are_aligned, for trees: with a last-token target every harvested
    # n-gram (window diagonals and tree paths with genuine links) must follow f.
    f, prompt = lcg_case()
    p = LookaheadProposer(LookaheadConfig(8, ngram=ngram, window=5, tree=True))
    p.window_at = window_at
    eng = TreeToyEngine(p, f)
    eng.add("r", prompt, 150)
    checked = 0
    while eng.reqs:
        eng.step()
        st = p.states.get("r")
        for g in (st.pool._lru if st else ()):
            if g[0] in prompt and g[:2] == tuple(prompt[prompt.index(g[0]):][:2]):
                continue                    # an n-gram of the (shuffled) prompt text itself
            assert all(f(g[i:i + 1]) == g[i + 1] for i in range(ngram - 1)), g
            checked += 1
    assert sum(eng.done["r"].accepted) > 20 and checked > 100
    assert eng.tree_steps > (0 if window_at == "chain" else 3)   # (most trees are a chain here)


def test_tree_harvest_keeps_only_genuine_links():
    from vllm_spec_plugins.proposers.base import RequestStep, StepContext
    p = LookaheadProposer(LookaheadConfig(4, ngram=3, tree=True))
    text = [1, 2, 3, 10, 11]
    p.propose(StepContext([RequestStep("r", np.array(text), [11], [])]))
    # verified tree: 20 -> 21 and 30 -> 31 off the root (11); target: 11 -> 30 -> 31 -> 32 and,
    # off the accepted path, 20 -> 21 -> 22
    d, P = [20, 21, 30, 31], [-1, 0, -1, 2]
    A = [30, 21, 22, 31, 32]
    t = np.array(text + [30, 31, 32])
    p.observe(p.states["r"], RequestStep("r", t, [30, 31, 32], d, A, P, [2, 3]))
    grams = set(p.states["r"].pool._lru)
    assert (20, 21, 22) in grams            # 21 is the target's token after 20: genuine
    assert (11, 20, 21) not in grams        # 20 is not the target's token after 11
    assert {(11, 30, 31), (30, 31, 32)} <= grams   # text


def _solo_tree(prompt, steps, f):
    eng = TreeToyEngine(LookaheadProposer(LookaheadConfig(6, ngram=3, tree=True, shared_pool=0)), f)
    eng.add("x", prompt, 10_000)
    return [_tree_key(eng.step()[0]) for _ in range(steps)]


def test_tree_state_isolation_reorder_finish_preempt():
    f = pair_table_target(50, 3, 0.1)
    pa, pb, pc = list(range(10)), list(range(10, 30)), [7, 7, 7]
    solo_b = _solo_tree(pb, 100, f)
    p = LookaheadProposer(LookaheadConfig(6, ngram=3, tree=True, shared_pool=0))
    eng = TreeToyEngine(p, f)
    eng.add("a", pa, 60)                  # finishes by itself (max_tokens) mid-run
    eng.add("b", pb, 10_000)
    eng.add("c", pc, 10_000)
    got_b = []
    a_done = None
    for step in range(100):
        if step == 30:
            eng.preempt("c")              # c's tree is dropped in flight
        if step == 50:
            eng.resume("c")
        order = list(eng.reqs)[::(-1) ** step]
        had_a = "a" in eng.reqs
        out = eng.step(order)             # a row per request still running after the step
        for rid, d in zip([r for r in order if r in eng.reqs], out):
            if rid == "b":
                got_b.append(_tree_key(d))
        if had_a and "a" not in eng.reqs:
            a_done = step                 # b's tree was pending while a finished
            assert "a" in eng.done
        if a_done is not None and step == a_done + 1:
            assert "a" not in p.states    # released on the next context
    assert a_done is not None and eng.done["a"].out == greedy(f, pa, 60)
    assert got_b == solo_b and any(len(x) == 2 and isinstance(x[0], tuple) for x in got_b)  # trees
    c = eng.reqs["c"]
    assert c.out == greedy(f, pc, len(c.out))


def _tau_pair(cases, k, window, ngram, guesses, tree_nodes, vocab=None):
    taus = []
    for tree in (False, True):
        outs = steps = 0
        for f, prompt, n in cases:
            p = LookaheadProposer(LookaheadConfig(k, window=window, ngram=ngram, guesses=guesses, tree=tree,
                                                  tree_nodes=tree_nodes), vocab_size=vocab)
            out, st, _ = simulate_tree(p, f, prompt, n, vocab_size=vocab, max_tree_nodes=tree_nodes)
            assert out == greedy(f, prompt, n)
            outs, steps = outs + len(out), steps + st
        taus.append(outs / steps)
    return taus


# Same verification budget (tree_nodes == k). Measured tree/chain tau per case (3 cases each):
# fib 1.01-1.08, pair50 1.01-1.10, branch3 1.02-1.14; lcg 0.75-1.19 per case, 0.95-1.02 overall
# (a last-token target: breadth is useless, the tree only pays for exploring it).
@pytest.mark.parametrize("target", ["fib", "pair50", "branch3"])
@pytest.mark.parametrize("cfg", [(8, 8, 3, 8, 8), (16, 8, 4, 8, 16)])
def test_tree_tau_at_least_chain(target, cfg):
    if target == "fib":
        cases = [(fib(50), p, 400) for p in ([1, 1], [3, 7], [2, 9])]
    else:
        kw = dict(branching=3) if target == "branch3" else {}
        cases = [(pair_table_target(50, s, 0.1, **kw), np.random.default_rng(10 * (target == "pair50") + 30 * (
            target == "branch3") + s).integers(0, 50, 32).tolist(), 300) for s in range(3)]
    chain_tau, tree_tau = _tau_pair(cases, *cfg, vocab=50)
    assert tree_tau >= chain_tau, (chain_tau, tree_tau)


def test_tree_tau_lcg_no_big_loss_and_pool_cap():
    cases = [(*lcg_case(s), 300) for s in range(3)]
    chain_tau, tree_tau = _tau_pair(cases, 8, 8, 3, 8, 8)
    assert tree_tau >= 0.9 * chain_tau and tree_tau > 2.0, (chain_tau, tree_tau)
    V, cap = 997, 128
    f = lambda t: (3 * t[-1] + 7 * t[-2] + 11) % V
    p = LookaheadProposer(LookaheadConfig(8, ngram=4, guesses=4, pool_cap=cap, shared_pool=0, tree=True), vocab_size=V)
    eng = TreeToyEngine(p, f, vocab_size=V)
    eng.add("r", [1, 2, 3], 1500)
    sizes, nbytes = [], []
    while eng.reqs:
        eng.step()
        if "r" in p.states:
            sizes.append(p.states["r"].pool.size())
            nbytes.append(p.state_nbytes("r"))
    assert max(sizes) == cap and eng.tree_steps > 20
    assert max(nbytes) < 2 * min(nbytes[sizes.index(cap):]) + 64 * 1024


def test_hidden_state_probe_catches_wrong_rows():
    """The engine test's probe is not vacuous: rows that are not the target's hidden states count."""
    import torch

    from vllm_spec_plugins.proposers.base import RequestStep, StepContext
    from vllm_spec_plugins.proposers.testing import AdversarialProposer, HiddenStateProbe
    g = torch.Generator().manual_seed(0)
    head = torch.randn(50, 8, generator=g)
    h = torch.randn(3, 8, generator=g)
    argmax = (h @ head.T).argmax(-1).tolist()
    probe = HiddenStateProbe(AdversarialProposer(2, vocab_size=50), head)
    step = lambda hs: StepContext([RequestStep("a", np.array([1, 2, 3]), [3], [7, 7], argmax, hidden_states=hs)],
                                  num_speculative_tokens=2)
    probe.propose(step(h))
    assert probe.stats == {"hidden_rows": 3, "hidden_mismatch": 0, "hidden_missing": 0}
    probe.propose(step(h.flip(0)))
    assert probe.stats["hidden_mismatch"] > 0
    probe.propose(step(None))
    assert probe.stats["hidden_missing"] == 1


def test_alternating_step_timer():
    """bench --step-cost's timer: chains and trees on alternate steps, each verify step's time filed
    under the kind it verified; output stays exact (0 drafts accepted). A fake clock: the target
    takes 1 unit per call, 2 more on a step verifying a tree."""
    from vllm_spec_plugins.proposers.testing import AlternatingStepTimer
    f = fib(50)
    ref = greedy(f, [4, 9], 60)
    now = [0.0]
    p = AlternatingStepTimer({"chain": AdversarialProposer(6, {(4, 9): ref}, vocab_size=50),
                              "tree": OracleTreeProposer(6, {(4, 9): ref}, 6, 3, vocab_size=50, adversarial=True)},
                             clock=lambda: now[0])
    kinds = []

    def target(t):
        now[0] += 1.0 + (2.0 if kinds and kinds[-1] == "tree" else 0.0)
        return f(t)
    eng = TreeToyEngine(p, target, vocab_size=50)
    orig = p.propose
    p.propose = lambda ctx: kinds.append(p._next) or orig(ctx)
    eng.add("r", [4, 9], 60)
    while eng.reqs:
        eng.step()
    assert eng.done["r"].out == ref and sum(eng.done["r"].accepted) == 0
    assert kinds[:4] == ["chain", "tree", "chain", "tree"]
    c, t = p.stats["chain_step_s"], p.stats["tree_step_s"]
    assert len(c) >= 25 and abs(len(c) - len(t)) <= 1
    assert min(t) > max(c)        # the slow (tree) steps are filed as tree steps


def test_cycling_step_timer_files_each_length():
    """bench --draft-cost's timer: chain lengths 0 (no drafts), 2 and 5 in turn, each step's time
    filed under the length it verified (a fake clock: the target takes 1 unit per verified
    position tells them apart); output stays exact."""
    from vllm_spec_plugins.proposers.testing import AlternatingStepTimer
    f = fib(50)
    ref = greedy(f, [4, 9], 90)
    now = [0.0]
    p = AlternatingStepTimer({"0": None, "2": AdversarialProposer(2, {(4, 9): ref}, vocab_size=50),
                              "5": AdversarialProposer(5, {(4, 9): ref}, vocab_size=50)}, clock=lambda: now[0])

    def target(t):
        now[0] += 1.0
        return f(t)
    eng = ToyEngine(p, target, vocab_size=50)
    eng.add("r", [4, 9], 90)
    while eng.reqs:
        eng.step()
    assert eng.done["r"].out == ref and sum(eng.done["r"].accepted) == 0
    s0, s2, s5 = (p.stats[f"{n}_step_s"] for n in ("0", "2", "5"))
    assert min(len(s0), len(s2), len(s5)) >= 25
    med = lambda v: sorted(v)[len(v) // 2]    # noqa: E731
    assert (med(s0), med(s2), med(s5)) == (1.0, 3.0, 6.0)   # 1, 3, 6 target calls per step


def test_ngram_match_is_the_latest_longest_match():
    """`ngram_match` against the definition: for n from the longest down, the latest earlier
    window equal to the last n tokens; the tokens after it and n."""
    from vllm_spec_plugins.proposers.base import ngram_match

    def reference(t, k, n_min, n_max):
        L = len(t)
        for n in range(min(n_max, L - 1), n_min - 1, -1):
            hits = [i for i in range(L - n) if t[i:i + n] == t[L - n:]]
            if hits:
                return t[hits[-1] + n:hits[-1] + n + k], n
        return [], 0

    rng = np.random.default_rng(0)
    for trial in range(3000):
        L = int(rng.integers(1, 40))
        t = rng.integers(0, int(rng.integers(2, 8)), L).tolist()
        n_min = int(rng.integers(1, 4))
        n_max = int(rng.integers(n_min, 6))
        k = int(rng.integers(1, 9))
        assert ngram_match(np.array(t), k, n_min, n_max) == reference(t, k, n_min, n_max), (t, k, n_min, n_max)


def test_shared_pool_tokens_are_classed_by_agreement():
    """A shared-pool token that followed its context every time it was seen, twice or more, is
    source 7; one that followed it in under half of the times source 8; one seen once source 4
    (`Goodput` prices each class at its own rate). `best` reports the counts."""
    p = LookaheadProposer(LookaheadConfig(4, shared_pool=1024))
    p.shared.add([7, 8, 9, 7, 8, 9, 7, 8, 9], 0)       # (7, 8) -> 9 three times of three
    p.shared.add([3, 4, 1, 3, 4, 2, 3, 4, 5], 0)       # (3, 4) -> 1, 2, 5 once each
    p.shared.add([60, 61, 62], 0)                      # (60, 61) -> 62 once
    assert p.shared.best([7, 8], 2, 2) == (9, 3, 3) and p.shared.best([3, 4], 2, 2)[1:] == (1, 3)
    D = p._DEPTHS
    for ctx, token, src in (([7, 8], 9, 7), ([3, 4], 5, 8), ([60, 61], 62, 4)):
        t = np.array([200, 201] + ctx)
        st = p.new_state(RequestStep("r", t, [int(t[-1])], []))
        p.observe(st, RequestStep("r", t, [int(t[-1])], []))
        p._classes = []
        drafts = p.propose_one(st, RequestStep("r", t, [int(t[-1])], []), 1)
        assert drafts == [token] and p._classes == [2 * src * D], (ctx, drafts, p._classes)
        p.release("r")
