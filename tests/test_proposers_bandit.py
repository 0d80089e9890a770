"""bandit_tree: shape family, discounted UCB, shaped trees from the lookahead pool, lossless in
the toy engine, and learning from a simulated (measured-by-clock) step cost. No vLLM."""
import random

import numpy as np
import pytest

from vllm_spec_plugins.proposers.bandit import (
    BanditTreeConfig,
    BanditTreeProposer,
    DiscountedUCB,
    batch_bucket,
    greedy_tokens,
    shape_family,
    shape_name,
)
from vllm_spec_plugins.proposers.testing import ToyEngine, greedy, pair_table_target


def depth_counts(parents):
    depth = []
    for p in parents:
        depth.append(depth[p] + 1 if p >= 0 else 1)
    return [depth.count(d) for d in range(1, max(depth, default=0) + 1)]


def test_shape_family():
    fam = shape_family(6, 4, 16)
    assert fam[0] == () and (1,) in fam and (1,) * 6 in fam and (4, 2, 1, 1, 1, 1) in fam
    assert len(set(fam)) == len(fam)
    assert all(sum(s) <= 16 and list(s) == sorted(s, reverse=True) for s in fam)
    assert () not in shape_family(6, 4, 16, backoff=False)
    # chains cut per token: the deepest chain alone stands for every depth
    assert shape_family(6, 4, 16, ladder=False) == [s for s in fam if max(s, default=2) > 1 or len(s) == 6]
    small = shape_family(8, 8, 8)
    assert all(sum(s) <= 8 for s in small) and (1,) * 8 in small and (8, 4) not in small and (5, 2) in small
    assert shape_name(()) == "none" and shape_name((4, 2, 1)) == "4-2-1"
    assert [batch_bucket(b) for b in (0, 1, 2, 3, 8, 31, 32, 33)] == [1, 1, 2, 2, 8, 16, 32, 32]


def test_ucb_finds_best_arm_and_tracks_drift():
    rng = random.Random(0)
    b = DiscountedUCB(4, exploration=0.2, discount=0.99)

    def play(mu, steps=1500, price=(1.0,) * 4, ratio=(1.0,) * 4):
        picks = []
        for _ in range(steps):
            a = b.choose(list(price))
            picks.append(a)
            b.step(a, {a: max(rng.gauss(mu[a], 0.5), 0.0)}, ratio[a])
        return picks
    assert play([1.0, 2.0, 1.5, 0.5])[500:].count(1) / 1000 > 0.8
    assert play([1.0, 0.5, 1.5, 3.0])[700:].count(3) / 800 > 0.8    # the world changes: arm 3 is best
    # arm 3 makes 3x the tokens of arm 0 at 4x its price: the model's, or the model's times a
    # measured ratio (what the cost model misses)
    assert play([1.0, 0.5, 0.8, 3.0], price=(1.0, 1.0, 1.0, 4.0))[500:].count(0) / 1000 > 0.8
    assert play([1.0, 0.5, 0.8, 3.0], ratio=(1.0, 1.0, 1.0, 4.0))[500:].count(0) / 1000 > 0.8
    b2 = DiscountedUCB(4, exploration=0.2, discount=0.99)
    b2.seed(b)
    assert b2.tokens(3) == pytest.approx(b.tokens(3)) and b2.ntok[3] == min(b.ntok[3], 8.0) and b2.pulls == [0] * 4
    assert b2.nres[3] == min(b.nres[3], 8.0) and b2.rate(3, [1.0] * 4) == pytest.approx(b.rate(3, [1.0] * 4))


def test_rate_prices_past_pulls_with_the_cost_model_of_now():
    """An arm's measured/predicted ratio is taken against the cost model as fitted now: at the
    features it ran with, its rate is its tokens over its measured seconds, whatever the model
    said when it was pulled (ratios against the model of the time sank early-pulled tree arms)."""
    from vllm_spec_plugins.proposers.cost import StepCost
    b = DiscountedUCB(2, exploration=0.0, discount=1.0, warmup=0)
    x_tree, x_chain = StepCost.features(5, True, 1), StepCost.features(3, True, 1)
    for _ in range(3):
        b.step(0, {0: 1.7, 1: 1.45}, 0.036, x_tree)
        b.step(1, {1: 1.45}, 0.034, x_chain)
    for w in ([0.0, 0.0001, 0.0, 0.0, 0.0], [0.029, 0.0017, 0.0, 0.0003, 0.0], [0.01, 0.005, 0.0, 0.002, 0.001]):
        price = [sum(c * v for c, v in zip(w, x)) for x in (x_tree, x_chain)]
        assert b.rate(0, price, w) == pytest.approx(1.7 / 0.036)
        assert b.rate(1, price, w) == pytest.approx(1.45 / 0.034)
        assert b.choose(price, None, w) == 0


def test_shaped_tree_respects_widths_and_is_lossless():
    V = 50
    f = pair_table_target(V, 3, 0.1, branching=3)
    for shape in [(1, 1, 1, 1), (2, 1, 1), (4, 2, 1, 1, 1, 1), (3, 3, 3)]:
        p = BanditTreeProposer(BanditTreeConfig(16, shapes=[shape]), vocab_size=V)
        eng = ToyEngine(p, f, vocab_size=V)
        seen = []
        orig = p.propose

        def spy(ctx, orig=orig):
            out = orig(ctx)
            seen.extend(d for d in out if len(d))
            return out
        p.propose = spy
        prompt = np.random.default_rng(1).integers(0, V, 24).tolist()
        eng.add("r", prompt, 200)
        while eng.reqs:
            eng.step()
        assert eng.done["r"].out == greedy(f, prompt, 200)
        assert seen
        # a chain arm drafts a chain (lookahead's chain form, cut per token)
        assert all(hasattr(t, "parents") != (max(shape) == 1) for t in seen)
        for t in seen:
            counts = depth_counts(list(t.parents)) if hasattr(t, "parents") else [1] * len(t)
            assert len(counts) <= len(shape) and all(c <= w for c, w in zip(counts, shape)), (shape, counts)
        if shape[0] > 1:
            assert max(depth_counts(list(t.parents))[0] for t in seen) > 1   # it does branch


def test_shaped_tree_puts_best_path_first():
    """The best path (the best child at each depth) leads, so its rows are causal rows for the
    kernel and need no KV move when accepted; the rest stay best first and every prefix is a tree;
    `subsets` indices follow the new order."""
    from vllm_spec_plugins.proposers.lookahead import shaped_tree
    #  candidates:    0    1    2    3    4    5    6
    toks = [10, 11, 12, 13, 14, 15, 16]
    pars = [-1, -1, 0, 0, 2, 1, -1]
    score = [0.6, 0.3, 0.4, 0.1, 0.3, 0.2, 0.05]
    order = sorted(range(7), key=lambda j: (-score[j], j))          # 0 2 1 4 5 3 6
    subs = {}
    tree, kept = shaped_tree(order, toks, pars, (3, 2, 1), 6, {"chain": (1, 1, 1)}, subs)
    assert kept[:3] == [0, 2, 4] and tree.parents[:3] == [-1, 0, 1]   # path 0 -> 2 -> 4 first
    assert kept[3:] == [1, 5, 6]                            # then best first (3: depth 2 is full)
    assert tree.tokens == [toks[i] for i in kept]
    for m in range(len(tree) + 1):                                      # every prefix is a tree
        assert all(p < i for i, p in enumerate(tree.parents[:m]))
    assert subs == {"chain": frozenset({0, 1, 2})}


def test_no_speculation_arm_drafts_nothing_and_stays_lossless():
    f = pair_table_target(50, 0, 0.1)
    p = BanditTreeProposer(BanditTreeConfig(8, shapes=[[]]), vocab_size=50)
    eng = ToyEngine(p, f, vocab_size=50)
    eng.add("r", list(range(10)), 60)
    while eng.reqs:
        assert all(d == [] for d in eng.step())
    assert eng.done["r"].out == greedy(f, list(range(10)), 60)


class CostClock:
    """A step costs base + per_token * (1 + drafted nodes) per request, + jump if it verifies any
    draft: the bandit reads it as measured time between two proposals."""

    def __init__(self, base, per_token, jump=0.0):
        self.t, self.base, self.per_token, self.jump = 0.0, base, per_token, jump

    def __call__(self):
        return self.t

    def charge(self, out):
        self.t += self.base + self.per_token * sum(1 + len(d) for d in out) + self.jump * any(len(d) for d in out)


def run_bandit(p, clock, f, prompts, max_tokens, tags=None):
    eng = ToyEngine(p, f, vocab_size=50)
    for i, pr in enumerate(prompts):
        eng.add(f"r{i}", pr, max_tokens, tags[i] if tags else None)
    while eng.reqs:
        clock.charge(eng.step())
    eng.flush()
    for i, pr in enumerate(prompts):
        assert eng.done[f"r{i}"].out == greedy(f, pr, max_tokens)
    return eng


def chosen(p, skip=0):
    arms = [h[3] for h in p.history][skip:]
    return {shape_name(p.shapes[a]): arms.count(a) / len(arms) for a in set(arms)}


def test_drafters_prompt_scan_is_not_an_arms_cost():
    """With a Mamba drafter, a new request's prompt scan (one-off work no arm chose) is left out
    of the step seconds the arms are rewarded with (it once sank a tree arm for a whole run)."""
    import torch

    from vllm_spec_plugins.proposers.mamba import StateSpaceDrafter
    torch.manual_seed(0)
    emb = torch.randn(50, 32)
    d = StateSpaceDrafter({"kind": "mamba", "head_dim": 16, "d_state": 8, "chunk": 8}, emb, emb,
                          torch.arange(50)).eval()
    f = pair_table_target(50, 5, 0.05, branching=3)
    prompts = [np.random.default_rng(s).integers(0, 50, 24).tolist() for s in range(3)]
    clock = CostClock(1.0, 0.01)
    p = BanditTreeProposer(BanditTreeConfig(8, shapes=[[1], [2, 1]]), clock=clock, vocab_size=50, drafter=d)
    scan = p.mamba._scan_from

    def costly_scan(req_id, tokens, snap):
        if snap is None:
            clock.t += 100.0          # a prompt scan: 100 steps' worth
        return scan(req_id, tokens, snap)
    p.mamba._scan_from = costly_scan
    run_bandit(p, clock, f, prompts, 40)
    assert p.mamba.once_seconds >= 300.0
    assert p.history and max(s for *_, s in p.history) < 10.0
    assert min(s for *_, s in p.history) > 0.5       # tokens per second: no step was charged 100 s


def test_lookahead_pools_prompt_indexing_is_not_an_arms_cost():
    """The same with the lookahead pool as drafter: indexing a new request's prompt (up to
    pool_cap tokens into the pool and the shared table) is left out of the arms' step seconds."""
    f = pair_table_target(50, 5, 0.05, branching=3)
    prompts = [np.random.default_rng(s).integers(0, 50, 24).tolist() for s in range(3)]
    clock = CostClock(1.0, 0.01)
    p = BanditTreeProposer(BanditTreeConfig(8, shapes=[[1], [2, 1]]), clock=clock, vocab_size=50)
    index, charged = p.lookahead._index_text, []

    def costly_index(st, t, req_id):
        if st.seen == 0:
            clock.t += 100.0          # a long prompt: 100 steps' worth
            charged.append(req_id)
        return index(st, t, req_id)
    p.lookahead._index_text = costly_index
    run_bandit(p, clock, f, prompts, 40)
    assert len(charged) == 3
    assert p.history and max(s for *_, s in p.history) < 10.0
    assert min(s for *_, s in p.history) > 0.5       # tokens per second: no step was charged 100 s


def test_backed_off_requests_cost_the_lookahead_pool_nothing():
    """While a request neither verified drafts last step nor drafts now, the lookahead pool skips
    it (at batch 32 "no speculation" wins most steps: the pool's upkeep was pure overhead); when
    it drafts again its text is indexed from where it left off, and the output stays exact."""
    f = pair_table_target(50, 5, 0.05, branching=3)
    prompts = [np.random.default_rng(s).integers(0, 50, 24).tolist() for s in range(3)]
    for shapes, none_only in (([[]], True), ([], False)):
        clock = CostClock(1.0, 0.01)
        p = BanditTreeProposer(BanditTreeConfig(16, shapes=shapes), clock=clock, vocab_size=50)
        calls, observe = [], p.lookahead.observe
        p.lookahead.observe = lambda st, req: (calls.append(req.req_id), observe(st, req))[1]
        run_bandit(p, clock, f, prompts, 60)
        assert (len(calls) == 0) == none_only, len(calls)
    # a request that drafts after a stretch backed off sees its whole text in the pool
    clock = CostClock(1.0, 0.01)
    p = BanditTreeProposer(BanditTreeConfig(16, shapes=[[], [1, 1]]), clock=clock, vocab_size=50)
    eng = ToyEngine(p, f, vocab_size=50)
    eng.add("r", prompts[0], 80)
    drafted = []
    while eng.reqs:
        st = p.lookahead.states.get("r")
        clock.charge(out := eng.step())
        if out and len(out[0]) and st is not None:
            drafted.append(st.seen == len(eng.reqs["r"].tokens) if "r" in eng.reqs else True)
    eng.flush()
    assert eng.done["r"].out == greedy(f, prompts[0], 80)
    assert drafted and all(drafted)


def test_bandit_speculates_when_cheap_and_backs_off_when_costly():
    f = pair_table_target(50, 5, 0.05, branching=3)
    prompts = [np.random.default_rng(s).integers(0, 50, 24).tolist() for s in range(4)]
    # verification nearly free (batch 1 on a big model): speculation must win
    clock = CostClock(1.0, 0.01)
    p = BanditTreeProposer(BanditTreeConfig(16), clock=clock, vocab_size=50)
    run_bandit(p, clock, f, prompts, 400)
    share = chosen(p, skip=200)
    assert share.get("none", 0) < 0.1, share
    # every drafted token costs three plain steps (a saturated batch): back off, and end up no
    # slower than never speculating. Without the row gate the bandit backs off by its arms (a
    # depth-1 chain that loses ~5% here is a near tie it keeps pulling now and then); with it (the
    # default) a costly arm drafts only the nodes that pay, so it costs less to pull
    none_clock = CostClock(1.0, 3.0)
    run_bandit(BanditTreeProposer(BanditTreeConfig(16, shapes=[[]]), clock=none_clock, vocab_size=50), none_clock, f,
               prompts, 1200)
    seconds = {}
    for gate in (False, True):
        clock = CostClock(1.0, 3.0)
        p = BanditTreeProposer(BanditTreeConfig(16, row_gate=gate), clock=clock, vocab_size=50)
        run_bandit(p, clock, f, prompts, 1200)
        share = chosen(p, skip=100)
        if not gate:
            assert share["none"] > 0.6 and share["none"] == max(share.values()), share
        assert clock.t <= 1.08 * none_clock.t, (gate, clock.t, none_clock.t)   # exploration included
        seconds[gate] = clock.t
    assert seconds[True] < seconds[False], seconds     # the gate spares the trees that do not pay
    assert "none" in p.describe() and p.inspect()["tables"]

    def plain(x):     # the state crosses processes (vLLM's msgpack): no numpy scalars
        return (x is None or type(x) in (int, float, str, bool)
                or (type(x) in (list, tuple) and all(map(plain, x)))
                or (type(x) is dict and all(map(plain, x.values()))))
    assert plain(p.inspect()), p.inspect()
    # at batch 32 only shapes within batch_node_budget / 32 = 2 nodes are ever tried, and the
    # chain, cut per token at the batch's price
    assert [p.shapes[a] for a in p.allowed(32)] == [(), (1,) * 6]


def test_bandit_matches_best_fixed_shape_in_hindsight():
    """Where the last token leaves three options and drafts are nearly free, the bandit's run
    (exploration included) is within 5% of the best fixed shape of its family in (simulated)
    time: it optimises tokens per second, not tokens per step."""
    f = pair_table_target(50, 7, 0.05, branching=3)
    prompts = [np.random.default_rng(10 + s).integers(0, 50, 24).tolist() for s in range(3)]

    def run(cfg):
        clock = CostClock(1.0, 0.005)     # one clock for the bandit and its lookahead drafter
        eng = run_bandit(BanditTreeProposer(cfg, clock=clock, vocab_size=50), clock, f, prompts, 1200)
        return sum(len(r.out) for r in eng.done.values()) / sum(r.steps for r in eng.done.values()), clock.t
    fixed = {s: run(BanditTreeConfig(16, shapes=[list(s)])) for s in shape_family(6, 4, 16)}   # every depth
    tau, seconds = run(BanditTreeConfig(16))
    assert tau > 2.5, (tau, fixed)          # it speculates deep (fixed: none 1.0, depth 2 <= 2.6)
    assert seconds <= 1.05 * min(sec for _, sec in fixed.values()), (seconds, fixed)


def test_scopes_keep_separate_tables_and_free_per_request_state():
    f = pair_table_target(50, 2, 0.1)
    prompts = [np.random.default_rng(s).integers(0, 50, 16).tolist() for s in range(4)]
    clock = CostClock(1.0, 0.05)
    p = BanditTreeProposer(BanditTreeConfig(8, scope="field:category"), clock=clock, vocab_size=50)
    run_bandit(p, clock, f, prompts, 50, tags=[{"category": c} for c in ("chat", "code", "chat", None)])
    assert {k for k, _ in p.tables} == {"chat", "code", "global"}
    clock = CostClock(1.0, 0.05)
    p = BanditTreeProposer(BanditTreeConfig(8, scope="request"), clock=clock, vocab_size=50)
    eng = run_bandit(p, clock, f, prompts, 50)
    eng.flush()
    assert p.tables == {} and p.lookahead.states == {} and p.pending == {}


def test_field_scope_tables_are_bounded(monkeypatch):
    """`field:NAME` keys come from what clients send: one request per distinct value keeps at most
    MAX_TABLES tables (plus those of one step's keys), the least recently used going first."""
    monkeypatch.setattr(BanditTreeProposer, "MAX_TABLES", 4)
    f = pair_table_target(50, 2, 0.1)
    prompts = [np.random.default_rng(s).integers(0, 50, 16).tolist() for s in range(10)]
    clock = CostClock(1.0, 0.05)
    p = BanditTreeProposer(BanditTreeConfig(8, scope="field:user"), clock=clock, vocab_size=50)
    run_bandit(p, clock, f, prompts, 20, tags=[{"user": f"u{i}"} for i in range(10)])
    sizes = []
    orig = p.propose
    p.propose = lambda ctx: sizes.append(len(p.tables)) or orig(ctx)
    run_bandit(p, clock, f, prompts[:1], 20, tags=[{"user": "u10"}])
    assert max(sizes) <= 4 + 1 and "u10" in {k for k, _ in p.tables}   # + the one key a step adds
    assert "u0" not in {k for k, _ in p.tables}


@pytest.mark.parametrize("kwargs", [dict(node_budget=20), dict(shapes=[[0, 1]]), dict(shapes=[[8, 8, 8]]),
                                    dict(scope="field:"), dict(discount=0.0), dict(max_depth=17)])
def test_validation(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        BanditTreeConfig(16, **kwargs)


def test_served_defaults_are_the_config_defaults():
    """What a test builds from `BanditTreeConfig()` is what `{"method": "bandit_tree"}` serves."""
    from vllm_spec_plugins.config import validate
    assert validate({"method": "bandit_tree"}) == BanditTreeConfig()
    p = BanditTreeProposer(BanditTreeConfig())
    assert (p.k, p.lookahead.tree_nodes, p.lookahead.window, p.lookahead.ngram) == (16, 16, 6, 4)
    assert p.shapes == shape_family(6, 4, 16, ladder=False) and p.lookahead.shared.cap == 65536


def test_side_observations_are_exact_for_sub_shapes():
    """A verified chain of depth d tells what every shorter chain would have made: the bandit
    counts those tokens without pulling the shorter arms, and they match a run that pulls them."""
    f = pair_table_target(50, 1, 0.1)
    prompt = np.random.default_rng(3).integers(0, 50, 24).tolist()
    clock = CostClock(1.0, 0.01)
    p = BanditTreeProposer(BanditTreeConfig(8, shapes=[[], [1], [1, 1, 1, 1]]), clock=clock, vocab_size=50)
    table = p.table(("global", 1))
    table.choose = lambda price, allowed=None, w=None: 2    # always pull the depth-4 chain
    eng = ToyEngine(p, f, vocab_size=50)
    eng.add("r", prompt, 300)
    while eng.reqs:
        clock.charge(eng.step())
    acc = eng.done["r"].accepted
    assert table.pulls[1] == 0 and table.pulls[2] > 50
    assert table.pulls[0] <= table.pulls[2] / 20    # only the plain steps that keep the cost's jump measured
    assert table.ntok[0] > 0 and table.ntok[1] > 0                  # tokens seen, never pulled
    # discount 1: the side observations' means are exact counts from the verified chains (every
    # step drafts: no row gate)
    p2 = BanditTreeProposer(BanditTreeConfig(8, shapes=[[], [1], [1, 1, 1, 1]], discount=1.0, row_gate=False),
                            clock=CostClock(1.0, 0.01), vocab_size=50)
    t2 = p2.table(("global", 1))
    t2.choose = lambda price, allowed=None, w=None: 2
    eng = ToyEngine(p2, f, vocab_size=50)
    eng.add("r", prompt, 300)
    while eng.reqs:
        p2.clock.charge(eng.step())
    acc = eng.done["r"].accepted[1:-1]     # steps whose verification was rewarded
    assert t2.tok[0] / t2.ntok[0] == 1.0
    assert t2.tok[1] / t2.ntok[1] == pytest.approx(np.mean([min(a, 1) + 1 for a in acc]), rel=0.02)
    assert t2.tok[2] / t2.ntok[2] == pytest.approx(np.mean([a + 1 for a in acc]), rel=0.02)


def test_a_chain_arm_learns_from_tree_steps():
    """With the lookahead pool a chain arm drafts lookahead's chain form, not a tree's best path:
    no tree contains it. In a greedy step its outcome is still known from the tokens the step
    made, so a chain arm that is never pulled is measured: its side observations match what its
    chains would have made, counted against the reference output."""
    f = pair_table_target(50, 3, 0.1, branching=3)
    prompt = np.random.default_rng(5).integers(0, 50, 24).tolist()
    ref = greedy(f, prompt, 300)
    p = BanditTreeProposer(BanditTreeConfig(8, shapes=[[], [1, 1, 1, 1], [2, 1, 1, 1]], discount=1.0,
                                            row_gate=False), clock=CostClock(1.0, 0.01), vocab_size=50)
    assert p.chain_arms == {1}
    table = p.table(("global", 1))
    table.choose = lambda price, allowed=None, w=None: 2    # always pull the tree
    exact = []
    orig = p.propose

    def spy(ctx):
        out = orig(ctx)
        rec = p.subsets.get("r")
        if rec is not None and 1 in rec[3]:
            done = len(ctx.requests[0].token_ids) - len(prompt)
            chain = [tok for _, tok, _ in rec[3][1]]
            n = next((j for j, x in enumerate(chain) if x != ref[done + j]), len(chain))
            exact.append(n + 1)
        return out
    p.propose = spy
    eng = ToyEngine(p, f, vocab_size=50)
    eng.add("r", prompt, 300)
    while eng.reqs:
        p.clock.charge(eng.step())
    assert eng.done["r"].out == ref
    assert table.pulls[1] == 0 and table.ntok[1] > 50
    assert table.tok[1] / table.ntok[1] == pytest.approx(np.mean(exact[:-1]), rel=0.03)


@pytest.mark.parametrize("row_gate", [True, False])
def test_after_unpredictable_traffic_the_chain_arm_is_taken_up_where_text_repeats(row_gate):
    """Traffic whose text no n-gram predicts, then traffic that repeats itself (one engine, one
    table). The first part drafts mostly nothing, the second runs well under the time of never
    speculating. With `row_gate` (the default) the chain arm is pulled throughout and its cut
    keeps nothing where nothing pays. Without it the chain is kept whole, so "no speculation"
    wins the first part; while it is pulled, the chain arm still drafts unverified every
    `SHADOW_EVERY`-th greedy step, is scored by the tokens the step made, and is priced with the
    jump only as often as it verifies drafts, so once the text repeats it is pulled again
    (without the shadow its mean stayed at the first part's, ~1 token, and the bandit stayed on
    "no speculation" throughout)."""
    rep = pair_table_target(50, 3, 0.0)

    def f(t):                # prompts that start with 0 repeat; the others are a hash of the last 6
        if t[0] == 0:
            return rep(t)
        h = (hash(tuple(t[-6:])) * 0x9E3779B1 + len(t)) & 0xFFFFFFFF
        return (h >> 7) % 50

    def repeating_part(shapes, seed, noise_first=True):
        clock = CostClock(1.0, 0.02, 0.3)
        p = BanditTreeProposer(BanditTreeConfig(16, shapes=shapes, row_gate=row_gate), clock=clock, vocab_size=50)
        eng = ToyEngine(p, f, vocab_size=50)
        rng = np.random.default_rng(seed)
        drafting = []
        for first in (1, 0) if noise_first else (0,):
            t0, prompts = clock.t, [[first] + rng.integers(1, 50, 23).tolist() for _ in range(4)]
            for i, pr in enumerate(prompts):
                eng.add(f"{first}-{i}", pr, 200)
            while eng.reqs:
                clock.charge(out := eng.step())
                if first:
                    drafting.append(any(map(len, out)))
            eng.flush()
            assert all(eng.done[f"{first}-{i}"].out == greedy(f, pr, 200) for i, pr in enumerate(prompts))
        return clock.t - t0, p, drafting
    spent, never = 0.0, 0.0
    for seed in range(3):
        t, p, drafting = repeating_part([], seed)
        assert np.mean(drafting) < 0.5, np.mean(drafting)     # the unpredictable part: mostly no drafts
        # "no speculation" chosen, or only pulled for the cost fit's plain steps
        assert chosen(p).get("none", 0) > 0.5 if not row_gate else chosen(p).get("none", 0) < 0.1, chosen(p)
        spent += t
        never += repeating_part([[]], seed, noise_first=False)[0]
    assert spent < 0.75 * never, (spent, never)


@pytest.mark.parametrize("per_token, dear", [(0.05, False), (0.6, True)])
def test_no_speculation_is_offered_where_a_verified_node_is_dear(per_token, dear):
    """The chain arm's cut stands in for "no speculation" only while a verified node costs under
    `CUT_BACKOFF_PRICE` tokens. At batch 8 where a node costs ~0.3 of a token "no speculation" is
    pulled only for the cost fit's plain steps; where it costs ~0.7 (a step verifying drafts as
    dear as on an AVX2 host) the tree arms' gated nodes, near break-even, lose to it, and it is
    chosen for most steps."""
    f = pair_table_target(50, 5, 0.1, branching=3)
    for seed in range(2):
        clock = CostClock(1.0, per_token, 0.3)
        p = BanditTreeProposer(BanditTreeConfig(16), clock=clock, vocab_size=50)
        rng = np.random.default_rng(seed)
        run_bandit(p, clock, f, [rng.integers(0, 50, 24).tolist() for _ in range(8)], 150)
        none = chosen(p).get("none", 0)
        assert none > 0.5 if dear else none < 0.1, (p.node_price(8), chosen(p))


def test_bandit_learns_under_continuous_traffic():
    """A new request every step (every step runs prefill work): the bandit still learns (the cost
    fit counts the prefill tokens) and backs off where drafts cost three plain steps, instead of
    exploring forever: few steps verify drafts, and the run costs what never speculating does
    (a verified node costs more than `CUT_BACKOFF_PRICE` tokens there: "no speculation" is
    offered, and the chain arm, cut per token, drafts nothing and costs the same)."""
    f = pair_table_target(50, 5, 0.05, branching=3)

    def run(shapes):
        clock = CostClock(1.0, 3.0)
        p = BanditTreeProposer(BanditTreeConfig(16, shapes=shapes), clock=clock, vocab_size=50)
        eng = ToyEngine(p, f, vocab_size=50)
        rng = np.random.default_rng(0)
        prompts, drafting = {}, []
        for i in range(300):
            prompts[f"r{i}"] = rng.integers(0, 50, 12).tolist()
            eng.add(f"r{i}", prompts[f"r{i}"], 12)
            clock.charge(out := eng.step())
            drafting.append(any(map(len, out)))
        while eng.reqs:
            clock.charge(out := eng.step())
            drafting.append(any(map(len, out)))
        eng.flush()
        for rid, pr in prompts.items():
            assert eng.done[rid].out == greedy(f, pr, 12)
        return p, clock.t, drafting
    p, seconds, drafting = run([])
    assert sum(sum(t.pulls) for t in p.tables.values()) > 200, p.describe()
    assert sum(drafting[100:]) < 0.1 * len(drafting[100:]), p.describe()
    assert seconds <= 1.02 * run([[]])[1], p.describe()


def test_mamba_drafter_trees_follow_shapes_stay_lossless_and_siblings_pay():
    """drafter 'mamba': every shape's trees respect its widths, output equals greedy decoding of
    the target, and against a target that takes the drafter's second choice at every 3rd token,
    a tree with siblings at each depth needs fewer steps than the drafter's chain (accepted
    siblings roll the drafter's state back correctly, or the chain after them would miss)."""
    import torch
    from test_proposers_mamba import V, drafter
    d = drafter()
    second = np.random.default_rng(4).random(256) < 0.3     # positions where the target differs

    def target(prefix):
        with torch.no_grad():
            h, _ = d(torch.tensor([list(prefix)]))
            top = d.logits(h[:, -1])[0].topk(2).indices
        return int(d.draft_vocab[top[int(second[len(prefix)])]])

    prompt = np.random.default_rng(3).integers(0, V, 12).tolist()
    want = greedy(target, prompt, 80)
    steps = {}
    for shape in [(1, 1, 1, 1), (2, 2, 2, 1), (3, 1, 1)]:
        clock = CostClock(1.0, 0.01)     # simulated step costs: what the bandit learns is reproducible
        p = BanditTreeProposer(BanditTreeConfig(8, shapes=[shape]), clock=clock, vocab_size=V, drafter=d)
        eng = ToyEngine(p, target, vocab_size=V)
        seen = []
        orig = p.propose

        def spy(ctx, orig=orig):
            out = orig(ctx)
            seen.extend(t for t in out if len(t))
            return out
        p.propose = spy
        eng.add("r", prompt, 80)
        while eng.reqs:
            clock.charge(eng.step())
        assert eng.done["r"].out == want, shape
        assert seen
        for t in seen:
            counts = depth_counts(list(t.parents))
            assert len(counts) <= len(shape) and all(c <= w for c, w in zip(counts, shape)), (shape, counts)
        steps[shape] = eng.done["r"].steps
        eng.step()                                   # the finished request is reported: state freed
        assert not p.mamba.slots and not p.lookahead.states
    assert steps[(2, 2, 2, 1)] < steps[(1, 1, 1, 1)], steps


def test_greedy_tokens_reads_only_the_target_tokens_the_step_made():
    nodes = [(0, 5, -1), (1, 7, -1), (2, 6, 0), (3, 8, 0)]    # spine 5 -> 6; leaves 7 and 8
    assert greedy_tokens(nodes, [5, 6, 9]) == 3      # the spine accepted, then the bonus
    assert greedy_tokens(nodes, [5, 8, 1]) == 3      # the leaf under 5
    assert greedy_tokens(nodes, [7]) == 2            # the step's chain missed at once; leaf 7 is what the target made
    assert greedy_tokens(nodes, [9]) == 1
    assert greedy_tokens(nodes, [5]) is None         # 5 accepted and the tree goes on: unknown


def test_mamba_drafter_wider_arms_are_observed_exactly_in_greedy_steps():
    """Pulling only a Mamba drafter's 1-1 chain, every greedy step also tells what the 3-1 tree
    (whose leaves were never verified) would have made: each count equals the target's own walk
    of that tree, and some steps show a leaf that would have been accepted."""
    from test_proposers_mamba import V, drafter
    d = drafter()
    second = np.random.default_rng(4).random(256) < 0.3

    def target(prefix):
        import torch
        with torch.no_grad():
            h, _ = d(torch.tensor([list(prefix)]))
            top = d.logits(h[:, -1])[0].topk(2).indices
        return int(d.draft_vocab[top[int(second[len(prefix)])]])

    def walk(nodes, prefix):
        up, path = -1, list(prefix)
        while (nxt := next((j for j, t, par in nodes if par == up and t == target(path)), None)) is not None:
            up, path = nxt, path + [target(path)]
        return len(path) - len(prefix) + 1

    # row_gate off: every node is kept, so the 3-1 tree is never a subset of the chain pulled
    p = BanditTreeProposer(BanditTreeConfig(8, shapes=[[1, 1], [3, 1]], discount=1.0, row_gate=False), vocab_size=V,
                           drafter=d)
    table = p.table(("global", 1))
    table.choose = lambda price, allowed=None, w=None: 0     # always the chain
    seen, orig = [], p._counterfactual

    def spy(r):
        out = orig(r)
        nodes = p.subsets[r.req_id][3].get(1)
        if nodes is not None:
            seen.append((out.get(1), walk(nodes, r.token_ids[:len(r.token_ids) - len(r.sampled)]), len(r.sampled)))
        return out
    p._counterfactual = spy
    prompt = np.random.default_rng(3).integers(0, V, 12).tolist()
    eng = ToyEngine(p, target, vocab_size=V)
    eng.add("r", prompt, 80)
    while eng.reqs:
        eng.step()
    assert eng.done["r"].out == greedy(target, prompt, 80)
    assert table.pulls[1] == 0 and len(seen) > 20 and table.ntok[1] == len(seen)
    assert all(got == want for got, want, _ in seen), seen
    assert any(got > made for got, _, made in seen)      # a leaf the chain did not have would have paid


def test_a_wider_shape_is_never_taken_for_a_subset_of_a_narrower_tree():
    """Side observations by subset: 1-1 is inside a verified 3-1 tree, but 3-1 is not inside a
    verified 1-1 chain (it used to be, cut to the chain's two nodes, so the 3-1 arm was credited
    with the chain's tokens whenever the chain was pulled)."""
    from vllm_spec_plugins.proposers.lookahead import shaped_tree
    toks, pars = [10, 11, 12, 13], [-1, -1, -1, 0]      # depth 1: 10, 11, 12; 13 under 10
    order = [0, 3, 1, 2]                                 # best first
    subs: dict = {}
    shaped_tree(order, toks, pars, (1, 1), 2, {"3-1": (3, 1)}, subs, cap=6)
    assert "3-1" not in subs
    tree, _ = shaped_tree(order, toks, pars, (3, 1), 4, {"1-1": (1, 1)}, subs, cap=6)
    assert list(tree.tokens) == [10, 13, 11, 12] and subs["1-1"] == {0, 1}
