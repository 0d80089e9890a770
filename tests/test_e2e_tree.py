"""Tree verification inside vLLM (float32): random draft trees that hide the true continuation
in one branch are accepted whole every step; outputs equal plain vLLM at batch 1, 8 and 32,
with preemption forced by a small KV cache; wrong trees are never accepted."""
import json

import pytest

from vllm_spec_plugins.tools.runner import run_isolated

MAX_TOKENS, DEPTH, NODES = 24, 3, 10


def _job(model, prompts, spec=None, batch_size=1, max_tokens=MAX_TOKENS, **kw):
    return {"model": model, "speculative_config": spec, "groups": {"all": prompts},
            "max_tokens": max_tokens, "temperature": 0.0, "batch_size": batch_size,
            "ignore_eos": True, "dtype": "float32", "max_model_len": 2048,
            "llm_kwargs": {"enforce_eager": True, **kw.pop("llm_kwargs", {})}, **kw}


@pytest.fixture(scope="module")
def prompts(heldout_prompts):
    return (heldout_prompts * 4)[:32]


@pytest.fixture(scope="module")
def plain(default_model, prompts):
    # DEPTH extra tokens so the oracle always has a full true branch to hide
    return run_isolated(_job(default_model, prompts, batch_size=32,
                             max_tokens=MAX_TOKENS + DEPTH))["groups"]["all"]


@pytest.fixture(scope="module")
def references(plain, tmp_path_factory):
    path = tmp_path_factory.mktemp("refs") / "refs.json"
    path.write_text(json.dumps([[p, o[0]] for p, o in zip(plain["prompt_token_ids"], plain["outputs"])]))
    return str(path)


def _check(got, plain, n):
    for i in range(n):
        assert got["outputs"][i][0] == plain["outputs"][i][0][:MAX_TOKENS], f"prompt {i} differs"


@pytest.mark.parametrize("batch_size,n_prompts,kv_blocks", [(1, 3, None), (8, 8, None), (32, 32, 40)])
def test_oracle_tree_accepts_true_branch(batch_size, n_prompts, kv_blocks, default_model, prompts,
                                         plain, references):
    spec = {"method": "oracle", "num_speculative_tokens": NODES, "references": references,
            "tree_nodes": NODES, "tree_depth": DEPTH}
    extra = {"num_gpu_blocks_override": kv_blocks} if kv_blocks else {}
    res = run_isolated(_job(default_model, prompts[:n_prompts], spec, batch_size,
                            llm_kwargs=extra, report_plugin_state=True))
    got = res["groups"]["all"]
    _check(got, plain, n_prompts)
    if kv_blocks:
        assert got["preemptions"] > 0, "the small KV cache did not force a preemption"
    # every drafting step accepted exactly the hidden branch: depth 1..DEPTH always, deeper never;
    # except a request's last drafting steps, whose trees are cut to the tokens it may still make
    # (max_tokens), at most DEPTH of them per request
    per_pos, drafts = got["accepted_per_pos"], got["drafts"]
    assert drafts > n_prompts * DEPTH, drafts
    assert all(drafts - n_prompts * DEPTH <= n <= drafts for n in per_pos[:DEPTH]), per_pos
    assert sum(per_pos[DEPTH:]) == 0, per_pos
    assert NODES * (drafts - n_prompts * DEPTH) <= got["draft_tokens"] <= NODES * drafts
    for worker in res["plugin_state"]:
        assert worker["requests"] <= 1


@pytest.mark.parametrize("batch_size", [1, 8])
def test_adversarial_tree_never_accepted(batch_size, default_model, prompts, plain, references):
    spec = {"method": "adversarial", "num_speculative_tokens": NODES, "references": references,
            "tree_nodes": NODES, "tree_depth": DEPTH}
    got = run_isolated(_job(default_model, prompts[:8], spec, batch_size))["groups"]["all"]
    _check(got, plain, 8)
    assert got["drafts"] > 0 and got["accepted"] == 0
