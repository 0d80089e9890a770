"""Lookahead (Jacobi + n-gram pool) proposer, the toy engine / simulate harness, oracle and
adversarial proposers. Pure python/numpy, no vLLM."""
import random

import numpy as np
import pytest

from vllm_spec_plugins.proposers.base import Proposer, ngram_lookup
from vllm_spec_plugins.proposers.lookahead import LookaheadProposer, NGramPool
from vllm_spec_plugins.proposers.testing import (AdversarialProposer, OracleProposer, ToyEngine, greedy,
                                                  simulate)


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
    p = LookaheadProposer(8, ngram=4, guesses=4, pool_cap=cap, vocab_size=V)
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


# ---------------------------------------------------------------------------------------------
# lookahead behaviour
# ---------------------------------------------------------------------------------------------


def test_incremental_prompt_lookup_matches_ngram_lookup():
    rng = np.random.default_rng(0)
    t = rng.integers(0, 6, 400)
    p = LookaheadProposer(5)
    st = p.new_state(None)
    for L in range(2, len(t)):
        p._index_text(st, t[:L])
        got = p._lookup(st, t[:L], t[max(L - 3, 0):L].tolist(), 5, 1)
        assert got == ngram_lookup(t[:L], 5, 1, 3), L


@pytest.mark.parametrize("ngram", [2, 3, 4, 5])
def test_jacobi_ngrams_are_aligned(ngram):
    # With a target that only looks at the last token, every genuine "token -> target's next
    # token" link is correct whatever came before, so a misaligned harvest shows up as a pool
    # n-gram that breaks f. Acceptances (window shifts) happen along the way.
    f, prompt = lcg_case()
    p = LookaheadProposer(6, ngram=ngram, window=5)
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
        out, steps, acc = simulate(LookaheadProposer(k), f, [1, 1], 1000, vocab_size=50)
        assert out == ref
        assert tau(out, steps) > 2.0
        assert len(acc) == steps - 1 and sum(acc[:-1]) + steps - 1 < len(out) <= sum(acc) + steps


def test_jacobi_ngrams_beat_prompt_lookup_on_non_repeating_text():
    f, prompt = lcg_case()
    ref = greedy(f, prompt, 300)
    assert len(set(ref)) == 300             # no token (hence no n-gram) of the output repeats

    out, steps, _ = simulate(PromptLookup(8), f, prompt, 300)
    assert out == ref and tau(out, steps) < 1.05

    out, steps, _ = simulate(LookaheadProposer(8, ngram=3), f, prompt, 300)
    assert out == ref and tau(out, steps) > 2.0

    # same proposer, engine without target argmax: no Jacobi n-grams -> no gain
    eng = ToyEngine(LookaheadProposer(8, ngram=3), f, collect_argmax=False)
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
        p = LookaheadProposer(5, window=3, ngram=3, guesses=2, pool_cap=64, vocab_size=V)
        eng = ToyEngine(p, f, vocab_size=V)      # asserts len(drafts) <= k and 0 <= token < V
        eng.add("r", [1, 2, 3, 4], 300)
        drafts = []
        while eng.reqs:
            drafts.append(eng.step())
        runs.append(drafts)
        assert eng.done["r"].out == greedy(f, [1, 2, 3, 4], 300)
    assert runs[0] == runs[1]
    # k shrinking per step (engine budget): never more than the step's k
    p = LookaheadProposer(6)
    eng = ToyEngine(p, fib(50), k=2)
    eng.add("r", [1, 1], 200)
    while eng.reqs:
        assert all(len(d) <= 2 for d in eng.step())


def test_vocab_filter():
    prompt = [1, 50, 51, 1, 50, 51, 1]               # prompt holds out-of-vocab tokens
    eng = ToyEngine(LookaheadProposer(4), lambda t: 1)
    eng.add("r", prompt, 5)
    assert 50 in eng.step()[0]                        # prompt lookup would draft them...
    eng = ToyEngine(LookaheadProposer(4, vocab_size=10), lambda t: 1, vocab_size=10)
    eng.add("r", prompt, 5)
    while eng.reqs:
        eng.step()                                    # ...the engine asserts 0 <= draft < 10


# ---------------------------------------------------------------------------------------------
# per-request state
# ---------------------------------------------------------------------------------------------


def _solo(prompt, steps, f):
    p = LookaheadProposer(4, ngram=3)
    eng = ToyEngine(p, f)
    eng.add("x", prompt, 10_000)
    return [eng.step()[0] for _ in range(steps)]


def test_state_isolation_reorder_finish_preempt():
    f = fib(50)
    pa, pb, pc = [1, 1], [3, 7], [2, 9]
    solo_a, solo_b = _solo(pa, 40, f), _solo(pb, 120, f)
    p = LookaheadProposer(4, ngram=3)
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
    (dict(window=0), "window"), (dict(window=5), "window"),
    (dict(ngram=1), "ngram"), (dict(ngram=6), "ngram"),
    (dict(guesses=0), "guesses"), (dict(pool_cap=0), "pool_cap"),
    (dict(guesses=9, pool_cap=8), "guesses"),
    (dict(prompt_lookup_min=0), "prompt_lookup_min"),
    (dict(prompt_lookup_min=4, prompt_lookup_max=3), "prompt_lookup_min"),
    (dict(prompt_lookup_max=-1), "prompt_lookup_max"),
    (dict(vocab_size=0), "vocab_size"), (dict(window=2.5), "window"),
])
def test_range_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        LookaheadProposer(4, **kwargs)


def test_valid_edge_configs():
    LookaheadProposer(1, window=1, ngram=2, guesses=1, pool_cap=1)
    p = LookaheadProposer(4, prompt_lookup_max=0)        # prompt lookup disabled
    out, _, _ = simulate(p, fib(50), [1, 1], 100)
    assert out == greedy(fib(50), [1, 1], 100)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LookaheadProposer(0)
