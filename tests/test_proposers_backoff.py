"""Back-off for chain proposers (proposers/backoff.py): a two-arm bandit per batch-size bucket on
measured tokens per second. The toy engine's clock charges a fixed cost per step plus a cost per
verified position, the way a target pass costs more with more tokens."""
import numpy as np

from vllm_spec_plugins.proposers.backoff import OFF, ON, Backoff
from vllm_spec_plugins.proposers.base import RequestStep, StepContext
from vllm_spec_plugins.proposers.lookahead import LookaheadProposer
from vllm_spec_plugins.proposers.testing import AdversarialProposer, OracleProposer, ToyEngine, greedy


def lcg(V=1024, a=5, c=3):
    return lambda t: (a * t[-1] + c) % V


class Clock:
    """Cost model: `fixed` per step + `per_token` per verified position (target call)."""

    def __init__(self, target, fixed: float, per_token: float):
        self.t, self.target, self.fixed, self.per_token = 0.0, target, fixed, per_token

    def __call__(self):
        return self.t

    def next(self, prefix):
        self.t += self.per_token
        return self.target(prefix)


def run(proposer_of, n_req, max_tokens, fixed, per_token, steps_out=None):
    target = lcg()
    clock = Clock(target, fixed, per_token)
    prompts = {f"r{i}": [7 + i, 3 * i + 1] for i in range(n_req)}
    refs = {tuple(p): greedy(target, p, max_tokens + 8) for p in prompts.values()}
    prop = Backoff(proposer_of(refs), clock=clock)
    eng = ToyEngine(prop, clock.next, vocab_size=1024)
    for rid, p in prompts.items():
        eng.add(rid, p, max_tokens)
    while eng.reqs:
        eng.step()
        clock.t += fixed
    eng.flush()
    for rid, p in prompts.items():
        assert eng.done[rid].out == refs[tuple(p)][:max_tokens], f"{rid}: output differs"
    return prop


def on_share(prop, skip=20):
    arms = [a for _, a in prop.history[skip:]]
    return sum(a == ON for a in arms) / len(arms)


def test_backs_off_when_drafts_never_pay():
    """Drafts that are never accepted only add cost: batch 8 settles on no speculation."""
    prop = run(lambda refs: AdversarialProposer(4, refs, vocab_size=1024), 8, 300, fixed=10.0, per_token=1.0)
    assert on_share(prop) < 0.1, prop.backoff_state()
    rates = prop.tables[8].means()
    assert rates[OFF] > rates[ON]


def test_keeps_speculating_when_it_pays():
    """Drafts that are always accepted (tau = k + 1) at batch 1, where a step is mostly fixed cost."""
    prop = run(lambda refs: OracleProposer(4, refs), 1, 400, fixed=10.0, per_token=1.0)
    assert on_share(prop) > 0.9, prop.backoff_state()
    assert prop.tables[1].means()[ON] > 2 * prop.tables[1].means()[OFF]


def test_lossless_and_state_kept_through_off_steps():
    """Lookahead under back-off: exact output, and its per-request state keeps observing the text
    on steps without drafts (its pool grows on both kinds of step)."""
    prop = run(lambda refs: LookaheadProposer(4, vocab_size=1024), 4, 200, fixed=1.0, per_token=1.0)
    assert prop.backoff_stats["steps_off"] > 0 and prop.backoff_stats["steps_on"] > 0
    assert prop.inner.states == {} and prop.seen == set()       # freed with the requests


def test_budget_zero_and_prefill_steps():
    """The engine's own budget of 0 pulls no arm; a step with a new request is not rewarded."""
    clock = Clock(lcg(), 1.0, 1.0)
    prop = Backoff(AdversarialProposer(3, vocab_size=1024), clock=clock)
    req = lambda rid, drafts, sampled: RequestStep(rid, np.array([1, 2, 3]), sampled, drafts)
    out = prop.propose(StepContext([req("a", [], [3])], num_speculative_tokens=0))
    assert out == [[]] and prop.history == [] and prop.pending is None
    prop.propose(StepContext([req("a", [], [3])]))                 # pulls an arm for bucket 1
    clock.t += 5
    prop.propose(StepContext([req("a", [9, 9, 9], [4]), req("b", [], [8])]))   # b is new: no reward
    assert sum(prop.tables[1].pulls) == 0
    clock.t += 5
    prop.propose(StepContext([req("a", [9, 9, 9], [4]), req("b", [9, 9, 9], [8])]))
    assert sum(prop.tables[2].pulls) == 1


def test_larger_bucket_does_not_explore_drafts_that_lose_at_a_smaller_one():
    """Drafts that lose at batch 2 are not explored at batch 10 (bucket 8): a draft step there
    costs more and accepts no more. Without the small-batch evidence bucket 8 does explore."""
    def serve(warm_small: bool):
        target = lcg()
        clock = Clock(target, 10.0, 1.0)
        prop = Backoff(AdversarialProposer(4, vocab_size=1024), clock=clock)
        eng = ToyEngine(prop, clock.next, vocab_size=1024)
        for i in range(2 if warm_small else 0):
            eng.add(f"s{i}", [7 + i, 1], 400)
        for _ in range(60 if warm_small else 0):
            eng.step()
            clock.t += 10.0
        for i in range(8):
            eng.add(f"b{i}", [40 + i, 2], 40)
        while eng.reqs:
            eng.step()
            clock.t += 10.0
        return prop

    cold = serve(False)
    assert cold.tables[8].pulls[ON] > 0
    warm = serve(True)
    assert warm.tables[2].means()[ON] < warm.tables[2].means()[OFF], warm.backoff_state()
    assert warm.tables[8].pulls[ON] == 0 and warm.tables[8].pulls[OFF] > 20, warm.backoff_state()


def test_learns_under_continuous_traffic():
    """A new request every step: back-off still learns, and settles on no drafts where they are
    never accepted."""
    target = lcg()
    clock = Clock(target, 10.0, 1.0)
    prop = Backoff(AdversarialProposer(4, vocab_size=1024), clock=clock)
    eng = ToyEngine(prop, clock.next, vocab_size=1024)
    for i in range(300):
        eng.add(f"r{i}", [7 + i % 900, 1], 12)
        eng.step()
        clock.t += 10.0
    while eng.reqs:
        eng.step()
    eng.flush()
    assert sum(sum(t.pulls) for t in prop.tables.values()) > 200, prop.backoff_state()
    assert on_share(prop, skip=50) < 0.1, prop.backoff_state()
