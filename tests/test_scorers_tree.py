"""Tests for the draft-tree verification core: packing, tree attention, greedy/sampled acceptance."""
import random
import zlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vllm_spec_plugins.scorers import (
    AcceptResult,
    DraftTree,
    greedy_accept,
    pack_trees,
    reference_tree_attention,
    sampled_accept,
    tree_attention_bias,
    verify_batch,
)

# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def random_parents(r, n, kind):
    """r: random.Random."""
    if kind == "chain":
        return list(range(-1, n - 1))
    if kind == "star":
        return [-1] * n
    if kind == "binary":
        return [(i - 1) // 2 if i else -1 for i in range(n)]
    if kind == "deep":  # mostly extends the previous node
        return [-1 if i == 0 else (i - 1 if r.random() < 0.7 else r.randrange(-1, i)) for i in range(n)]
    return [r.randrange(-1, i) for i in range(n)]  # uniform random recursive tree


def ancestors_by_hand(parents, i):
    out = set()
    while i >= 0:
        out.add(i)
        i = parents[i]
    return out


def greedy_by_hand(tokens, parents, argmax):
    """Enumerate every root-to-node path whose tokens follow the target argmax chain; the greedy
    walk takes the first matching child at each level, i.e. the lexicographically smallest path
    by node ids where an extension ranks before its own prefix. Without duplicate sibling tokens
    this is simply the longest matching path."""
    n = len(tokens)
    matching = [()]
    for i in range(n):
        path = []
        j = i
        while j >= 0:
            path.append(j)
            j = parents[j]
        path = path[::-1]
        rows = [0] + [x + 1 for x in path[:-1]]
        if all(tokens[x] == argmax[r] for x, r in zip(path, rows)):
            matching.append(tuple(path))
    best = min(matching, key=lambda p: p + (n + 1,))
    bonus = argmax[best[-1] + 1] if best else argmax[0]
    return list(best), bonus


def check_path(tree, res):
    nodes = res.accepted_nodes
    assert res.accepted_tokens == [tree.tokens[i] for i in nodes]
    prev = -1
    for i in nodes:
        assert tree.parents[i] == prev
        prev = i


# ---------------------------------------------------------------------------------------------
# tree structure, validation, packing
# ---------------------------------------------------------------------------------------------


def test_tree_basics():
    t = DraftTree([5, 6, 7, 5, 9], [-1, -1, 0, 0, 2])
    assert t.depths == [1, 1, 2, 2, 3]
    assert t.children == [[0, 1], [2, 3], [], [4], [], []]
    assert t.paths() == [[0], [1], [0, 2], [0, 3], [0, 2, 4]]
    assert [t.path(i) for i in range(5)] == t.paths()
    c = DraftTree.from_chain([3, 1, 4])
    assert c.parents == [-1, 0, 1] and c.depths == [1, 2, 3] and c.max_depth == 3
    e = DraftTree([], [])
    assert len(e) == 0 and e.ancestor_mask().tolist() == [[True]] and e.max_depth == 0


@pytest.mark.parametrize("kwargs, msg", [
    (dict(tokens=[1, 2], parents=[-1]), "len"),
    (dict(tokens=[1, 2], parents=[-1, 1]), "parent"),
    (dict(tokens=[1, 2], parents=[-2, 0]), "parent"),
    (dict(tokens=[1, -3], parents=[-1, 0]), "negative"),
    (dict(tokens=[1, 2], parents=[-1, 0], draft_probs=torch.ones(3, 4)), "draft_probs"),
    (dict(tokens=[1, 2], parents=[-1, 0], draft_probs=torch.ones(2)), "draft_probs"),
    (dict(tokens=[1, 7], parents=[-1, 0], draft_probs=torch.ones(2, 4)), "vocab"),
])
def test_tree_validation(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        DraftTree(**kwargs)


def test_bad_inputs():
    t = DraftTree([1, 2], [-1, 0])
    with pytest.raises(ValueError):
        greedy_accept(t, torch.zeros(2, 4))
    with pytest.raises(ValueError):
        sampled_accept(t, torch.ones(4, 4))
    with pytest.raises(ValueError, match="vocab"):
        sampled_accept(t, torch.ones(3, 2))
    with pytest.raises(ValueError):
        pack_trees([t], [1, 2])
    with pytest.raises(ValueError):
        verify_batch([t], torch.zeros(4, 5), [0.0])
    with pytest.raises(ValueError):
        verify_batch([t], torch.zeros(3, 5), [0.0, 1.0])


def test_pack_example():
    t = DraftTree([3, 4, 5], [-1, -1, 0])
    pk = pack_trees([t, DraftTree([], []), DraftTree.from_chain([9, 8])], [10, 0, 4], [7, 1, 2])
    assert pk.input_ids.tolist() == [7, 3, 4, 5, 1, 2, 9, 8]
    assert pk.positions.tolist() == [10, 11, 11, 12, 0, 4, 5, 6]
    assert pk.depths.tolist() == [0, 1, 1, 2, 0, 0, 1, 2]
    assert pk.query_start_loc.tolist() == [0, 4, 5, 8]
    assert pk.seq_lens.tolist() == [14, 1, 7]
    assert pk.tree_masks[0].tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    assert pk.block_mask().shape == (8, 8)
    assert pack_trees([t], [3]).input_ids[0].item() == -1
    b = tree_attention_bias(pk.tree_masks[0], torch.float16)
    assert b.dtype == torch.float16
    assert torch.equal(b == 0, pk.tree_masks[0]) and torch.isinf(b[~pk.tree_masks[0]]).all()


# ---------------------------------------------------------------------------------------------
# fuzz
# ---------------------------------------------------------------------------------------------

KINDS = ["chain", "star", "binary", "deep", "random"]


def _random_tree(r, vocab):
    kind = r.choice(KINDS)
    n = r.randrange(17) if kind in ("chain", "deep") else r.randrange(25)  # depth <= 16
    return DraftTree([r.randrange(vocab) for _ in range(n)], random_parents(r, n, kind))


def _argmax_following(r, tree, vocab):
    """Target argmax that follows a random child with prob 0.8, so long matches happen."""
    return [tree.tokens[r.choice(kids)] if kids and r.random() < 0.8 else r.randrange(vocab)
            for kids in tree.children]


def test_fuzz_invariants():
    r = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    vocab, ntrees = 4, 0
    while ntrees < 10_000:
        B = r.randint(1, 7)
        trees = [_random_tree(r, vocab) for _ in range(B)]
        ntrees += B
        plens = [r.randrange(50) for _ in range(B)]
        roots = [r.randrange(vocab) for _ in range(B)]
        pk = pack_trees(trees, plens, roots)
        qsl, ids, positions = pk.query_start_loc.tolist(), pk.input_ids.tolist(), pk.positions.tolist()
        depths, seq_lens = pk.depths.tolist(), pk.seq_lens.tolist()
        assert qsl[0] == 0 and qsl[-1] == len(ids) == len(positions) == len(depths)
        ams, temps = [], []
        for b, t in enumerate(trees):
            s, e = qsl[b], qsl[b + 1]
            n = len(t)
            assert e - s == n + 1 and seq_lens[b] == plens[b] + n + 1
            assert ids[s:e] == [roots[b]] + t.tokens
            assert depths[s:e] == [0] + t.depths
            pos = positions[s:e]
            assert pos[0] == plens[b]
            want = np.zeros((n + 1, n + 1), dtype=bool)
            want[:, 0] = True
            for i in range(n):
                anc = ancestors_by_hand(t.parents, i)
                want[i + 1, [a + 1 for a in anc]] = True
                assert pos[i + 1] == plens[b] + len(anc) == pos[t.parents[i] + 1] + 1
            assert np.array_equal(pk.tree_masks[b].numpy(), want)
            # greedy vs by hand
            am = _argmax_following(r, t, vocab)
            res = greedy_accept(t, torch.tensor(am))
            check_path(t, res)
            assert (res.accepted_nodes, res.bonus_token) == greedy_by_hand(t.tokens, t.parents, am)
            ams.append(am)
            temps.append(0.0 if r.random() < 0.5 else r.uniform(0.3, 2.0))
        # batched verify == per-request calls with the same generator stream
        logits = torch.randn(qsl[-1], vocab)
        logits[torch.arange(qsl[-1]), torch.tensor(sum(ams, []))] += 3.0  # argmax == am
        g2 = torch.Generator()
        g2.set_state(gen.get_state())
        got = verify_batch(trees, logits, temps, gen)
        for b, t in enumerate(trees):
            rows = logits[qsl[b]:qsl[b + 1]]
            if temps[b] == 0:
                ref = greedy_accept(t, rows)
            else:
                probs = torch.softmax(rows / temps[b], -1)
                ref = sampled_accept(t, probs, g2)
                check_path(t, ref)
                assert 0 <= ref.bonus_token < vocab
            assert got[b] == ref
    assert ntrees >= 10_000


def test_fuzz_sampled_support():
    """Sampled acceptance never emits a token the target gives probability 0, and one-hot
    draft_probs behave exactly like point-mass drafts (same random stream)."""
    rng, r = np.random.default_rng(1), random.Random(1)
    vocab = 5
    for it in range(1500):
        t = _random_tree(r, vocab)
        n = len(t)
        p = torch.from_numpy(rng.dirichlet(np.ones(vocab), n + 1))
        p[torch.from_numpy(rng.random((n + 1, vocab)) < 0.3)] = 0
        p[:, int(rng.integers(vocab))] += 0.01  # keep every row non-empty
        g1, g2 = torch.Generator().manual_seed(it), torch.Generator().manual_seed(it)
        res = sampled_accept(t, p, g1)
        check_path(t, res)
        rows = [0] + [i + 1 for i in res.accepted_nodes]
        for row, tok in zip(rows, res.output_tokens):
            assert p[row, tok] > 0
        onehot = F.one_hot(torch.tensor(t.tokens, dtype=torch.long), vocab).double() if n else torch.zeros(0, vocab)
        assert sampled_accept(DraftTree(t.tokens, t.parents, onehot), p, g2) == res


# ---------------------------------------------------------------------------------------------
# tree attention
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("H, Hkv", [(4, 4), (4, 2), (6, 1)])
def test_tree_attention_equals_per_path_causal(H, Hkv):
    r = random.Random(H * 10 + Hkv)
    torch.manual_seed(H * 10 + Hkv)
    D = 8
    trees = [DraftTree([r.randrange(9) for _ in range(n)], random_parents(r, n, kind))
             for n, kind in [(0, "chain"), (5, "chain"), (7, "star"), (10, "binary"), (12, "random"), (9, "deep")]]
    plens = [3, 0, 5, 1, 7, 2]
    pk = pack_trees(trees, plens, [0] * len(trees))
    T = len(pk.input_ids)
    q = torch.randn(T, H, D, dtype=torch.float64)
    k_new, v_new = torch.randn(2, T, Hkv, D, dtype=torch.float64)
    scale = 0.3
    for b, t in enumerate(trees):
        s, e = pk.query_start_loc[b].item(), pk.query_start_loc[b + 1].item()
        P = plens[b]
        kc, vc = torch.randn(2, P, Hkv, D, dtype=torch.float64)
        mask = pk.tree_masks[b]
        out = reference_tree_attention(q[s:e], kc, vc, k_new[s:e], v_new[s:e], mask, scale)
        # each row == last position of plain attention over prefix + root + path (independent GQA)
        for row in range(e - s):
            rows = [0] + ([x + 1 for x in t.path(row - 1)] if row else [])
            Kp = torch.cat([kc, k_new[s:e][rows]]).transpose(0, 1)[None]
            Vp = torch.cat([vc, v_new[s:e][rows]]).transpose(0, 1)[None]
            ref = F.scaled_dot_product_attention(q[s + row][None, :, None], Kp, Vp, scale=scale, enable_gqa=True)
            torch.testing.assert_close(out[row], ref[0, :, 0], rtol=1e-10, atol=1e-10)
        # the additive bias gives the same thing through SDPA (default scale here)
        bias = torch.cat([torch.zeros(e - s, P, dtype=torch.float64), tree_attention_bias(mask, torch.float64)], 1)
        Kf = torch.cat([kc, k_new[s:e]]).transpose(0, 1)[None]
        Vf = torch.cat([vc, v_new[s:e]]).transpose(0, 1)[None]
        ref = F.scaled_dot_product_attention(q[s:e].transpose(0, 1)[None], Kf, Vf, attn_mask=bias, enable_gqa=True)
        torch.testing.assert_close(reference_tree_attention(q[s:e], kc, vc, k_new[s:e], v_new[s:e], mask),
                                   ref[0].transpose(0, 1), rtol=1e-10, atol=1e-10)
        # a chain is ordinary causal attention
        if t.parents == list(range(-1, len(t) - 1)):
            causal = torch.ones(e - s, e - s, dtype=torch.bool).tril()
            assert torch.equal(mask, causal)


def test_tree_attention_low_precision():
    torch.manual_seed(0)
    t = DraftTree([1, 2, 3], [-1, -1, 0])
    q = torch.randn(4, 2, 16, dtype=torch.bfloat16)
    k, v = torch.randn(2, 4, 1, 16, dtype=torch.bfloat16)
    kc, vc = torch.randn(2, 5, 1, 16, dtype=torch.bfloat16)
    out = reference_tree_attention(q, kc, vc, k, v, t.ancestor_mask())
    ref = reference_tree_attention(q.double(), kc.double(), vc.double(), k.double(), v.double(), t.ancestor_mask())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)


# ---------------------------------------------------------------------------------------------
# sampled acceptance is lossless: distribution tests
# ---------------------------------------------------------------------------------------------

V = 6
_CACHE: dict = {}


def model(salt, ctx):
    """Deterministic hash-seeded 'model': context tuple -> probs over V tokens (some exactly 0)."""
    key = (salt, ctx)
    if key not in _CACHE:
        rng = np.random.default_rng(zlib.crc32(repr(key).encode()))
        p = rng.dirichlet(np.full(V, 0.8))
        if rng.random() < 0.4:
            p[rng.integers(V)] = 0.0
            p /= p.sum()
        _CACHE[key] = p
    return _CACHE[key]


def target(ctx):
    return model("target", ctx)


def draft(ctx):
    return model("draft", ctx)


def accept_all(tree, probs, gen, **_):
    """WRONG rule: always accept the first child."""
    row, nodes = 0, []
    while tree.children[row]:
        nodes.append(tree.children[row][0])
        row = nodes[-1] + 1
    bonus = int(torch.multinomial(probs[row], 1, generator=gen))
    return AcceptResult([tree.tokens[i] for i in nodes], bonus, nodes)


def no_residual(tree, probs, gen, **_):
    """WRONG rule: correct acceptance test, but the bonus comes from p instead of the residual."""
    res = sampled_accept(tree, probs, gen)
    row = res.accepted_nodes[-1] + 1 if res.accepted_nodes else 0
    res.bonus_token = int(torch.multinomial(probs[row], 1, generator=gen))
    return res


class _Contexts:
    """All contexts up to length `maxlen` as integer ids, with target/draft tables."""

    def __init__(self, maxlen=4):
        tuples, level = [()], [()]
        for _ in range(maxlen):
            level = [c + (t,) for c in level for t in range(V)]
            tuples += level
        idx = {c: i for i, c in enumerate(tuples)}
        self.child = np.array([[idx.get(c + (t,), -1) for t in range(V)] for c in tuples])
        self.PT = np.stack([target(c) for c in tuples])
        self.PD = np.stack([draft(c) for c in tuples])


_CTX = []


def contexts():
    if not _CTX:
        _CTX.append(_Contexts())
    return _CTX[0]


def _draw_rows(q, u):
    """Vectorized inverse-CDF sampling of one token per row of q."""
    cdf = q.cumsum(1)
    return np.minimum((cdf <= (u * cdf[:, -1])[:, None]).sum(1), V - 1)


def simulate(parents, mode, trials, seed, tokens=None, accept=sampled_accept, L=3):
    """Run `trials` rounds of draft -> accept and return the first L emitted tokens per round
    (completed by sampling the target when fewer were emitted), as an int array [trials, L].

    mode: 'point' (fixed tokens), 'iid' (siblings i.i.d. from the draft model), 'swor' (siblings
    without replacement, raw q rows + without_replacement=True), 'swor_given' (adjusted rows)."""
    C = contexts()
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    n, ar = len(parents), np.arange(trials)
    ctx = np.zeros((trials, n + 1), dtype=np.int64)   # context id of every tree row
    toks = np.zeros((trials, n), dtype=np.int64)
    rows = np.zeros((trials, n, V))
    taken = {}
    for i, p in enumerate(parents):  # draft all trials at once, node by node
        pid = ctx[:, p + 1]
        if mode == "point":
            t = np.full(trials, tokens[i])
        else:
            q = C.PD[pid]
            if mode != "iid":
                for prev in taken.get(p, []):
                    q[ar, prev] = 0
                q = q / q.sum(1, keepdims=True)
            t = _draw_rows(q, rng.random(trials))
            taken.setdefault(p, []).append(t)
            rows[:, i] = C.PD[pid] if mode == "swor" else q
        toks[:, i] = t
        ctx[:, i + 1] = C.child[pid, t]
    probs = C.PT[ctx]
    out = np.full((trials, L), -1, dtype=np.int64)
    fixed = DraftTree(tokens, parents) if mode == "point" else None
    for tr in range(trials):
        tree = fixed or DraftTree(toks[tr].tolist(), parents, torch.from_numpy(rows[tr]))
        res = accept(tree, torch.from_numpy(probs[tr]), gen, without_replacement=(mode == "swor"))
        seq = res.output_tokens[:L]
        out[tr, :len(seq)] = seq
    cid = np.zeros(trials, dtype=np.int64)
    for j in range(L):  # complete short outputs from the target itself
        miss = out[:, j] < 0
        out[miss, j] = _draw_rows(C.PT[cid[miss]], rng.random(int(miss.sum())))
        cid = C.child[cid, out[:, j]]
    return out


def chi2_pvalue(samples, L):
    """Chi-square goodness of fit of the first L tokens against the exact target joint.
    Cells with expected count < 5 are pooled; a hit on a probability-0 cell fails outright."""
    codes = samples[:, :L] @ (V ** np.arange(L - 1, -1, -1))
    counts = np.bincount(codes, minlength=V ** L).astype(np.float64)
    probs = np.ones(V ** L)
    for c in range(V ** L):
        seq = [(c // V ** (L - 1 - j)) % V for j in range(L)]
        for j in range(L):
            probs[c] *= target(tuple(seq[:j]))[seq[j]]
    N = len(samples)
    exp = probs * N
    if counts[probs == 0].sum() > 0:
        return 0.0
    big = exp >= 5
    obs_b = np.append(counts[big], counts[~big].sum())
    exp_b = np.append(exp[big], exp[~big].sum())
    keep = exp_b > 0
    obs_b, exp_b = obs_b[keep], exp_b[keep]
    stat = float(((obs_b - exp_b) ** 2 / exp_b).sum())
    df = len(obs_b) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


SHAPES = {
    "chain": [-1, 0, 1],
    "star": [-1, -1, -1, -1],
    "binary": [-1, -1, 0, 0, 1, 1],
    "random": [-1, -1, 0, 1, 0, 2, 3, -1],
}
TRIALS = 10_000  # every planted bug tried (see report) fails these at p < 1e-60


def _pick_tokens(parents):
    """Point-mass tokens: likely ones (top target token) plus duplicates among siblings."""
    toks, ctxs = [], [()]
    seen = {}
    for i, p in enumerate(parents):
        pc = ctxs[p + 1]
        order = np.argsort(-target(pc))
        k = seen.get(p, 0)
        seen[p] = k + 1
        t = int(order[[0, 1, 0, 2, 3][k % 5]])  # third sibling duplicates the first
        toks.append(t)
        ctxs.append(pc + (t,))
    return toks


CASES = [(s, "point") for s in SHAPES] + [("chain", "iid"), ("binary", "iid"), ("random", "iid"),
                                           ("star", "swor"), ("binary", "swor"), ("star", "swor_given"),
                                           ("star", "iid")]


@pytest.mark.parametrize("shape, mode", CASES)
def test_sampled_accept_is_lossless(shape, mode):
    parents = SHAPES[shape]
    seed = zlib.crc32(f"{shape}-{mode}".encode())
    tokens = _pick_tokens(parents) if mode == "point" else None
    s = simulate(parents, mode, TRIALS, seed, tokens)
    for L in (1, 2, 3):
        pv = chi2_pvalue(s, L)
        assert pv > 1e-4, f"{shape}/{mode}: first {L} tokens deviate from target (p={pv:.2e})"


@pytest.mark.parametrize("shape, mode, rule", [
    ("binary", "point", accept_all),
    ("star", "point", no_residual),
    ("chain", "iid", no_residual),
])
def test_distribution_test_has_power(shape, mode, rule):
    """The same harness rejects wrong acceptance rules."""
    parents = SHAPES[shape]
    tokens = _pick_tokens(parents) if mode == "point" else None
    s = simulate(parents, mode, 5_000, 123, tokens, accept=rule)
    assert min(chi2_pvalue(s, L) for L in (1, 2)) < 1e-6


def test_swor_drafts_need_the_flag():
    """Drafts sampled without replacement but verified with the i.i.d. rule are biased."""
    parents = SHAPES["star"]

    def iid_rule(tree, probs, gen, **_):
        return sampled_accept(tree, probs, gen, without_replacement=False)

    s = simulate(parents, "swor", 5_000, 7, accept=iid_rule)
    assert chi2_pvalue(s, 1) < 1e-6


def test_coupled_accept_emits_what_plain_sampling_emits():
    """coupled_accept with `sample` = the target's sampler on one random stream: over random trees
    and random targets, the emitted tokens are exactly plain sampling's with that stream (one draw
    per emitted token), whatever the tree; and nodes are accepted (chi-square) with p(token)."""
    from vllm_spec_plugins.scorers import coupled_accept
    rng = random.Random(0)
    V, trials = 6, 4000
    for trial in range(trials):
        n = rng.randrange(0, 9)
        tree = DraftTree([rng.randrange(V) for _ in range(n)], [rng.randrange(-1, i) for i in range(n)])
        probs = torch.softmax(torch.randn(n + 1, V, generator=torch.Generator().manual_seed(trial)), -1)
        draws = []

        def sample(row, gen=torch.Generator().manual_seed(10_000 + trial)):
            draws.append(row)
            return int(torch.multinomial(probs[row], 1, generator=gen))
        res = coupled_accept(tree, sample)
        # plain: the same stream drawn position by position along the emitted path
        gen = torch.Generator().manual_seed(10_000 + trial)
        rows = [0] + [i + 1 for i in res.accepted_nodes]
        plain = [int(torch.multinomial(probs[r], 1, generator=gen)) for r in rows]
        assert res.output_tokens == plain and draws == rows
        assert [tree.tokens[i] for i in res.accepted_nodes] == res.accepted_tokens
        assert all(tree.parents[b] == a for a, b in zip([-1] + res.accepted_nodes, res.accepted_nodes))
    with pytest.raises(ValueError):
        coupled_accept(DraftTree([1], [-1], torch.ones(1, V) / V), lambda r: 0)


def test_coupled_accept_acceptance_rate():
    """A star of distinct tokens is entered with probability sum_c p(t_c), a chain's first node
    with p(t_0): the rate of recursive rejection sampling for point-mass drafts."""
    from vllm_spec_plugins.scorers import coupled_accept
    p = torch.tensor([0.5, 0.2, 0.2, 0.1])
    gen = torch.Generator().manual_seed(3)
    for tree, want in ((DraftTree([1, 2], [-1, -1]), 0.4), (DraftTree([0, 3], [-1, 0]), 0.5)):
        hits = sum(bool(coupled_accept(tree, lambda r: int(torch.multinomial(p, 1, generator=gen))).accepted_nodes)
                   for _ in range(20_000))
        assert abs(hits / 20_000 - want) < 0.015, (hits, want)


def test_row_argmax_matches_torch():
    """bf16 logits: torch's fp32 argmax, first maximum on ties, NaN above all."""
    from vllm_spec_plugins.scorers import row_argmax
    g = torch.Generator().manual_seed(0)
    for rows in (5, 8, 3, 12):
        x = torch.randn(rows, 300, generator=g).mul(4).round().to(torch.bfloat16)   # many ties
        x[0, 17] = float("nan")
        x[1, :] = x[1].max()
        assert row_argmax(x).tolist() == x.float().argmax(-1).tolist()
