"""Sampled decoding (T=0.7) with speculation follows the target's distribution: two-sample
chi-square tests of the 2nd..4th token against plain vLLM sampling (tiny model, many samples).
Chain drafts go through vLLM's rejection sampler, tree drafts through ours."""
import json
from collections import Counter

import pytest
import torch

from vllm_spec_plugins.tools.runner import run_isolated

N, TOKENS = 600, 4


def _job(model, spec=None, **kw):
    return {"model": model, "speculative_config": spec, "groups": {"all": [[1, 504, 3156, 28, 14]] * N},
            "max_tokens": TOKENS, "temperature": 0.7, "batch_size": 64, "ignore_eos": True,
            "dtype": "float32", "max_model_len": 256, "llm_kwargs": {"enforce_eager": True}, **kw}


def chi2_two_sample(a: list, b: list, top: int = 12) -> float:
    """p-value that samples a and b come from one distribution (top categories + 'other')."""
    ca, cb = Counter(a), Counter(b)
    cats = [t for t, _ in (ca + cb).most_common(top)]
    oa = [ca[c] for c in cats] + [len(a) - sum(ca[c] for c in cats)]
    ob = [cb[c] for c in cats] + [len(b) - sum(cb[c] for c in cats)]
    stat, dof = 0.0, -1
    na, nb = len(a), len(b)
    for x, y in zip(oa, ob):
        if x + y == 0:
            continue
        ea, eb = (x + y) * na / (na + nb), (x + y) * nb / (na + nb)
        stat += (x - ea) ** 2 / ea + (y - eb) ** 2 / eb
        dof += 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def test_chi2_has_power():
    import random
    rng = random.Random(0)
    a = [rng.choices(range(5), [5, 4, 3, 2, 1])[0] for _ in range(N)]
    b = [rng.choices(range(5), [5, 4, 3, 2, 1])[0] for _ in range(N)]
    d = [rng.choices(range(5), [1, 1, 1, 1, 1])[0] for _ in range(N)]
    assert chi2_two_sample(a, b) > 1e-3
    assert chi2_two_sample(a, d) < 1e-6


@pytest.fixture(scope="module")
def plain(tiny_model):
    return run_isolated(_job(tiny_model))["groups"]["all"]


@pytest.fixture(scope="module")
def references(tiny_model, tmp_path_factory):
    g = run_isolated({**_job(tiny_model), "temperature": 0.0, "max_tokens": TOKENS + 3,
                      "groups": {"all": [[1, 504, 3156, 28, 14]]}})["groups"]["all"]
    path = tmp_path_factory.mktemp("refs") / "refs.json"
    path.write_text(json.dumps([[g["prompt_token_ids"][0], g["outputs"][0][0]]]))
    return str(path)


@pytest.mark.parametrize("method", ["lookahead", "oracle_tree", "oracle_chain", "bandit_tree", "bandit_tree_mamba",
                                    "mamba", "cascade",
                                    pytest.param("cascade_ngram", marks=pytest.mark.extended)])
def test_sampled_follows_target(method, tiny_model, plain, references, tiny_mamba_drafter):
    # goodput off: drafts every step, so the acceptance under test runs all along
    spec = {"lookahead": {"method": "lookahead", "num_speculative_tokens": 3, "goodput": False},
            "mamba": {"method": "mamba", "num_speculative_tokens": 3, "model": tiny_mamba_drafter,
                      "goodput": False},
            "cascade": {"method": "cascade", "num_speculative_tokens": 6, "model": tiny_mamba_drafter,
                        "goodput": False},
            "cascade_ngram": {"method": "cascade", "levels": ["ngram", "mamba"], "num_speculative_tokens": 6,
                              "model": tiny_mamba_drafter, "goodput": False},
            # row_gate off: every node its arm's shape holds is drafted (none is cut as not paying)
            "bandit_tree": {"method": "bandit_tree", "num_speculative_tokens": 8, "exploration": 1.0,
                            "row_gate": False},
            "bandit_tree_mamba": {"method": "bandit_tree", "num_speculative_tokens": 8, "exploration": 1.0,
                                  "drafter": "mamba", "model": tiny_mamba_drafter, "row_gate": False},
            "oracle_chain": {"method": "oracle", "num_speculative_tokens": 3, "references": references},
            "oracle_tree": {"method": "oracle", "num_speculative_tokens": 8, "references": references,
                            "tree_nodes": 8, "tree_depth": 3}}[method]
    got = run_isolated(_job(tiny_model, spec))["groups"]["all"]
    assert got["drafts"] > 0
    if method.startswith("oracle"):
        assert got["accepted"] > 0        # the greedy branch is sometimes sampled too
    for pos in range(1, TOKENS):
        a = [o[0][pos] for o in plain["outputs"]]
        b = [o[0][pos] for o in got["outputs"]]
        p = chi2_two_sample(a, b)
        assert p > 1e-3, f"{method}: token {pos} distribution differs from plain sampling (p={p:.2e})"


SEEDED_SPECS = {
    # goodput on (the default): which drafts are cut depends on measured time, the output must not
    "lookahead": {"method": "lookahead", "num_speculative_tokens": 4},
    "lookahead_tree": {"method": "lookahead", "num_speculative_tokens": 8, "tree": True, "goodput": False},
    "bandit_tree": {"method": "bandit_tree", "num_speculative_tokens": 8, "exploration": 1.0},
    "bandit_tree_mamba": {"method": "bandit_tree", "num_speculative_tokens": 8, "exploration": 1.0, "drafter": "mamba",
                          "model": "vllm_spec_plugins:smollm2-135m-instruct-mamba"},
    "mamba": {"method": "mamba", "num_speculative_tokens": 4, "model": "vllm_spec_plugins:smollm2-135m-instruct-mamba",
              "goodput": False},
    "cascade": {"method": "cascade", "num_speculative_tokens": 6,
                "model": "vllm_spec_plugins:smollm2-135m-instruct-mamba", "goodput": False},
    "cascade_ngram": {"method": "cascade", "levels": ["ngram", "mamba"], "num_speculative_tokens": 6,
                      "model": "vllm_spec_plugins:smollm2-135m-instruct-mamba", "goodput": False},
}


SEEDED_PARAMS = [{"temperature": 0.0}, {"temperature": 0.8}, {"temperature": 1.0, "top_p": 0.9},
                 {"temperature": 0.9, "top_k": 20}]


def _seeded_job(model, prompts, spec=None):
    """Greedy, T=0.8, top-p and top-k requests, each with its own seed, in one batch; then the same
    prompts again, now prefix-cached: the scheduler admits them as decodes padded with
    placeholder drafts."""
    per_request = [{"seed": 100 + i, **SEEDED_PARAMS[i % 4]} for i in range(len(prompts))]
    return {"model": model, "speculative_config": spec, "groups": {"first": prompts, "again": prompts},
            "max_tokens": 32, "temperature": 0.8, "batch_size": 8, "dtype": "float32", "max_model_len": 2048,
            "per_request_params": per_request, "enable_prefix_caching": True, "llm_kwargs": {"enforce_eager": True}}


@pytest.fixture(scope="module")
def seeded_prompts(default_model, heldout_prompts):
    """8 prompts of 129 tokens (held-out text): on the second pass 128 are prefix-cached (one full
    block), so each is admitted as a decode padded with placeholder drafts."""
    from transformers import AutoTokenizer

    from vllm_spec_plugins.tools.runner import to_token_prompts
    toks = [t for p in to_token_prompts(AutoTokenizer.from_pretrained(default_model), heldout_prompts) for t in p]
    return [toks[37 * i: 37 * i + 129] for i in range(8)]


@pytest.fixture(scope="module")
def plain_seeded(default_model, seeded_prompts):
    return run_isolated(_seeded_job(default_model, seeded_prompts))["groups"]


@pytest.mark.parametrize("method", [
    pytest.param(m, marks=pytest.mark.extended
                 if m in ("mamba", "cascade", "cascade_ngram", "bandit_tree_mamba") else [])
    for m in SEEDED_SPECS])
def test_seeded_sampling_equals_plain(method, default_model, seeded_prompts, plain_seeded):
    """Seeded sampled requests (T=0.8, top-p, top-k, each its own seed; greedy ones in the same
    batch), fresh and prefix-cached, give plain vLLM's own output token for token: each emitted
    token is drawn with vLLM's sampler and the request's generator exactly as without
    speculation, and a draft is accepted iff it equals that draw (scorers.coupled_accept). So
    seeded output repeats whatever the drafts were, including bandit shapes and goodput's cuts
    chosen from measured time."""
    got = run_isolated(_seeded_job(default_model, seeded_prompts, SEEDED_SPECS[method]))["groups"]
    assert got["first"]["drafts"] > 0
    assert got["first"]["accepted"] > 0
    for g in ("first", "again"):
        for i, (a, b) in enumerate(zip(got[g]["outputs"], plain_seeded[g]["outputs"])):
            assert a == b, (f"{method}: {g} pass, request {i} ({SEEDED_PARAMS[i % 4]}, seed {100 + i}) "
                            "differs from plain vLLM")
