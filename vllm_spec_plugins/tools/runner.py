"""Run one engine configuration over prompt sets and return outputs, timings and vLLM's own
`vllm:spec_decode_*` counters. Used by scripts/bench.py and the end-to-end tests.

Each configuration runs in its own process (`run_isolated`): vLLM's CPU backend does not always
survive a second engine in one process, and Prometheus counters are per process.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

# No OMP_WAIT_POLICY: the OpenMP runtime's default is what `vllm serve` runs with. PASSIVE
# (threads sleep between parallel regions) slows vLLM's CPU decode (scripts/omp_policy.py
# measures it); the test suite sets it (tests/conftest.py), for engines that share the cores
# with pytest, not for speed.
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "NUMBA_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_LOGGING_LEVEL": "WARNING",
}
_MARK = "@@RESULT@@"      # starts the child's result on stdout (vLLM may log there too)


def spec_metrics(llm) -> dict:
    """vLLM's spec-decode counters (cumulative since engine start)."""
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "preemptions": 0, "accepted_per_pos": []}
    names = {"vllm:num_preemptions": "preemptions", "vllm:spec_decode_num_drafts": "drafts",
             "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
    for m in llm.get_metrics():
        if m.name in names:
            out[names[m.name]] += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            vals = [int(v) for v in m.values]
            acc = out["accepted_per_pos"]
            out["accepted_per_pos"] = [a + b for a, b in zip(acc + [0] * len(vals), vals)] if acc else vals
    return out


def _diff(a: dict, b: dict) -> dict:
    per_pos = [y - (a["accepted_per_pos"][i] if i < len(a["accepted_per_pos"]) else 0)
               for i, y in enumerate(b["accepted_per_pos"])]
    return {k: b[k] - a[k] for k in ("drafts", "draft_tokens", "accepted", "preemptions")} | {
        "accepted_per_pos": per_pos}


def to_token_prompts(tokenizer, rows: list) -> list[list[int]]:
    out = []
    for r in rows:
        if isinstance(r, list):
            out.append(r)
        elif isinstance(r, str):
            out.append(tokenizer.encode(r))
        elif "messages" in r:
            text = tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True,
                                                 tokenize=False)
            out.append(tokenizer.encode(text, add_special_tokens=False))
        else:
            out.append(tokenizer.encode(r["prompt"]))
    return [[int(t) for t in p] for p in out]


def run(job: dict) -> dict:
    """job: model, speculative_config|None, groups {name: [rows]}, max_tokens, temperature,
    batch_size, dtype, seed, max_model_len, logprobs(optional), top_k(optional), n(optional),
    tag_category (requests carry extra_args={"category": group name}), cold (no warm-up request
    at all: the measured prompts are the engine's first), warm (rows served first,
    not measured), warm_batch (serve them this many at a time: the engine gets that many request
    slots, and admits only batch_size at a time after the warm-up)."""
    eng = _Engine(job)
    for name, rows in job["groups"].items():
        eng.result["groups"][name] = eng.group(name, rows)
    return eng.finish()


def _scheduler(llm):
    """The engine's scheduler, where the engine core runs in this process (`ENGINE_ENV`), else None."""
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    return getattr(core, "scheduler", None)


def _params(sp: dict, category: str | None):
    """SamplingParams of one request; `category` goes to extra_args (a key for bandit_tree's scope)."""
    from vllm import SamplingParams
    return SamplingParams(**sp, extra_args={"category": category}) if category else SamplingParams(**sp)


class _Engine:
    """One engine of a job: `group` serves a prompt set and returns its measurements."""

    def __init__(self, job: dict):
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        t0 = time.perf_counter()
        batch = job.get("batch_size", 1)
        slots = max(batch, job.get("warm_batch") or 0) if job.get("warm") else batch
        self.job = job
        self.llm = llm = LLM(model=job["model"], dtype=job.get("dtype", "float32"),
                             speculative_config=job.get("speculative_config"),
                             max_model_len=job.get("max_model_len", 2048),
                             max_num_seqs=slots, seed=job.get("seed", 0),
                             enable_prefix_caching=job.get("enable_prefix_caching", False),
                             disable_log_stats=False, **job.get("llm_kwargs", {}))
        startup = time.perf_counter() - t0
        self.tok = tok = llm.get_tokenizer()
        self.sp = sp = dict(max_tokens=job.get("max_tokens", 64), temperature=job.get("temperature", 0.0),
                            seed=job.get("sample_seed"), ignore_eos=job.get("ignore_eos", False))
        for key in ("top_p", "top_k", "n", "logprobs", "prompt_logprobs"):
            if key in job:
                sp[key] = job[key]
        if not job.get("cold"):     # cold: the measured prompts are the engine's first requests
            llm.generate([TokensPrompt(prompt_token_ids=tok.encode("Hello"))],
                         SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)  # warm-up
        # served first, not measured (state shared across requests warms up)
        if job.get("warm") and not job.get("cold"):
            tag = job.get("tag_category")   # tagged as measured rows are: bandit tables keyed by category warm up
            llm.generate([TokensPrompt(prompt_token_ids=p) for p in to_token_prompts(tok, job["warm"])],
                         [_params(sp, r.get("category") if tag else None) for r in job["warm"]], use_tqdm=False)
            if slots > batch:   # measured at batch_size: vLLM's admission cap (in-process engine)
                _scheduler(llm).max_num_active_reqs = batch
        mode = getattr(getattr(llm.llm_engine, "vllm_config", None), "compilation_config", None)
        self._n_started = 0
        self.result = {"startup_s": startup, "groups": {},
                       "compilation_mode": getattr(getattr(mode, "mode", None), "name", None)}

    def _begin(self, name: str, rows: list) -> tuple[list, object]:
        """Counters before a prompt set: (prompts, params); `_end` reads them back."""
        job, llm = self.job, self.llm
        if job.get("report_plugin_state"):
            from vllm_spec_plugins.proposer import plugin_steps
            self.result.setdefault("group_start_step", {}).setdefault(name, llm.collective_rpc(plugin_steps)[0])
        self._m0 = spec_metrics(llm)
        if job.get("report_plugin_stats"):
            from vllm_spec_plugins.proposer import plugin_stats
            self._s0 = llm.collective_rpc(plugin_stats)[0]
        return to_token_prompts(self.tok, rows), _params(self.sp, name if job.get("tag_category") else None)

    def group(self, name: str, rows: list) -> dict:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        job, llm, sp = self.job, self.llm, self.sp
        prompts, params = self._begin(name, rows)
        per_request = job.get("per_request_params")
        t0 = time.perf_counter()
        if job.get("abort"):
            outs = _generate_with_aborts(llm, prompts, params, **job["abort"])
        else:
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                [SamplingParams(**(sp | pr)) for pr in per_request] if per_request else params,
                                use_tqdm=False)
        return self._end(prompts, outs, time.perf_counter() - t0)

    def start(self, name: str, rows: list) -> None:
        """Queue a prompt set for `step` (as `LLM.generate` would: all at once, final outputs only)."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        prompts, params = self._begin(name, rows)
        params.output_kind = RequestOutputKind.FINAL_ONLY
        self._ids = [f"{name}-{self._n_started}-{i}" for i in range(len(prompts))]
        self._n_started += 1
        self._prompts, self._outs, self._seconds, self._steps = prompts, {}, 0.0, 0
        self._finished_s: dict[str, float] = {}      # request id -> the set's seconds when it finished
        # the engine's id of each request -> [its id here, output tokens seen, target steps]; None
        # where the scheduler is out of reach (`_count_target_steps`: tau from vLLM's counter)
        self._queued = getattr(_scheduler(self.llm), "requests", None)
        self._made: dict[str, list] | None = {} if self._queued is not None else None
        for rid, p in zip(self._ids, prompts):
            inner = self.llm.llm_engine.add_request(rid, TokensPrompt(prompt_token_ids=p), params)
            if self._made is not None:
                self._made[inner if isinstance(inner, str) else rid] = [rid, 0, 0]

    def step(self) -> dict:
        """One engine step of the started set: {"more": requests left, "s": its seconds}; the set's
        measurements once it is done (`done`)."""
        eng = self.llm.llm_engine
        t0 = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t0
        self._seconds += dt
        self._steps += 1
        self._count_target_steps(outs)
        for o in outs:
            if o.finished:
                self._outs[o.request_id] = o
                self._finished_s[o.request_id] = self._seconds
        return {"more": eng.has_unfinished_requests(), "s": dt}

    def _count_target_steps(self, outs) -> None:
        """Each request's target steps, exactly: a step that decodes a request gives it one token
        or more (its accepted drafts and the target's own), so its steps are the steps after
        which it holds more output tokens than before. vLLM's accepted-draft counter cannot give
        them: it also takes the drafts a request accepts past its end (max_tokens, end of
        sequence), which the engine drops (vLLM's ngram and suffix draft past max_tokens; ours do
        not). Read from the in-process scheduler (the engine's own process: `ENGINE_ENV`); a
        request that finished has left it, and its final output tells."""
        if self._made is None:
            return
        requests = self._queued
        ends = {o.request_id: len(o.outputs[0].token_ids) for o in outs if o.finished and len(o.outputs) == 1}
        for inner, m in self._made.items():
            req = requests.get(inner)
            n = req.num_output_tokens if req is not None else ends.get(m[0], m[1])
            if n > m[1]:
                m[1], m[2] = n, m[2] + 1

    def done(self) -> dict:
        """The set's measurements, with its engine steps, each request's latency (the seconds from
        the set's start, when all its requests arrive, to the step that finished it) and, where
        they were counted (`_count_target_steps`), its target steps: tau is then exact."""
        g = self._end(self._prompts, [self._outs[rid] for rid in self._ids], self._seconds)
        if self._made is not None and all(m[1] == len(self._outs[m[0]].outputs[0].token_ids)
                                          for m in self._made.values()):
            steps = {m[0]: m[2] for m in self._made.values()}
            # per request too, in prompt order: tau's spread over prompts (bench.py's `paired_tau_gap`)
            g = _with_rates(g | {"target_steps": sum(steps.values()),
                                 "request_steps": [steps[rid] for rid in self._ids]})
        return g | {"steps": self._steps, "request_seconds": [self._finished_s[rid] for rid in self._ids]}

    def _end(self, prompts: list, outs: list, dt: float) -> dict:
        """A prompt set's measurements: outputs, seconds, vLLM's counters and ours since `_begin`."""
        job, llm = self.job, self.llm
        m = _diff(self._m0, spec_metrics(llm))
        token_ids = [[list(c.token_ids) for c in o.outputs] for o in outs]
        g = _with_rates({"outputs": token_ids, "texts": [[c.text for c in o.outputs] for o in outs],
                         "prompt_token_ids": prompts, "seconds": dt,
                         "generated_tokens": sum(len(c) for t in token_ids for c in t), **m})
        if job.get("report_plugin_state"):      # goodput's cost fit and counters at the group's end
            from vllm_spec_plugins.proposer import plugin_goodput
            gp = llm.collective_rpc(plugin_goodput)[0]
            if gp is not None:
                g["goodput"] = {k: v for k, v in gp.items() if k != "tries"}
        if job.get("report_plugin_stats"):      # the proposer's own counters over this group
            from vllm_spec_plugins.proposer import plugin_stats
            s0, s1 = self._s0, llm.collective_rpc(plugin_stats)[0]
            g["plugin_stats"] = {      # counters: difference; lists: new entries
                k: v[len(s0.get(k, ())):] if isinstance(v, list) else v - s0.get(k, 0) for k, v in s1.items()}
        if job.get("logprobs") is not None:
            g["logprobs"] = [
                [[{str(t): lp.logprob for t, lp in pos.items()} for pos in (c.logprobs or [])]
                 for c in o.outputs] for o in outs]
        if job.get("prompt_logprobs") is not None:     # per prompt position (the first is None)
            g["prompt_logprobs"] = [[pos and {str(t): lp.logprob for t, lp in pos.items()}
                                     for pos in (o.prompt_logprobs or [])] for o in outs]
        return g

    def finish(self) -> dict:
        if self.job.get("report_plugin_state"):
            from vllm import SamplingParams
            from vllm.inputs import TokensPrompt

            from vllm_spec_plugins.proposer import plugin_state_summary
            # Finished requests are released on the engine's next step: run one tiny request first.
            self.llm.generate([TokensPrompt(prompt_token_ids=self.tok.encode("Hi"))],
                              SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
            self.result["plugin_state"] = self.llm.collective_rpc(plugin_state_summary)
        return self.result


def merge_groups(a: dict, b: dict) -> dict:
    """One group's measurements over two prompt sets served one after the other (`EngineProcess`
    turns): lists concatenate, counts add, rates are recomputed."""
    out = dict(a)
    for k in ("outputs", "texts", "prompt_token_ids", "logprobs", "prompt_logprobs"):
        if k in a:
            out[k] = a[k] + b[k]
    for k in ("seconds", "generated_tokens", "drafts", "draft_tokens", "accepted", "preemptions"):
        out[k] = a[k] + b[k]
    out.pop("target_steps", None)
    out.pop("request_steps", None)
    if "target_steps" in a and "target_steps" in b:      # exact only where both sets were counted
        out["target_steps"] = a["target_steps"] + b["target_steps"]
        if "request_steps" in a and "request_steps" in b:
            out["request_steps"] = a["request_steps"] + b["request_steps"]
    pa, pb = a["accepted_per_pos"], b["accepted_per_pos"]
    out["accepted_per_pos"] = [x + y for x, y in zip(pa + [0] * (len(pb) - len(pa)), pb + [0] * (len(pa) - len(pb)))]
    if "plugin_stats" in a:
        out["plugin_stats"] = {k: a["plugin_stats"][k] + v for k, v in b["plugin_stats"].items()}
    return _with_rates(out)


def tau_of(generated: float, accepted: float) -> float:
    """Tokens per target step: each step of a request makes its accepted drafts + 1 tokens, so the
    steps are the generated tokens less the accepted drafts (the benchmark and the load tables)."""
    steps = generated - accepted
    return generated / steps if steps else 0.0


def _with_rates(g: dict) -> dict:
    """tokens_per_s and tau of a group from its counts: tau from its target steps where they were
    counted (`_Engine._count_target_steps`), else from vLLM's accepted-draft counter (`tau_of`)."""
    n, steps = g["generated_tokens"], g.get("target_steps")
    tau = n / steps if steps else tau_of(n, g["accepted"])
    return g | {"tokens_per_s": n / g["seconds"] if g["seconds"] else 0.0, "tau": tau}


def _generate_with_aborts(llm, prompts, params, after_steps: int, indices: list[int]):
    """Step the engine by hand and abort requests `indices` after `after_steps` steps (mid
    speculation). Aborted requests come back with whatever they had produced."""
    from vllm.inputs import TokensPrompt
    eng = llm.llm_engine
    ids = [f"req-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, TokensPrompt(prompt_token_ids=p), params)
    last, steps = {}, 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            last[o.request_id] = o
        steps += 1
        if steps == after_steps:
            eng.abort_request([ids[i] for i in indices])
    from types import SimpleNamespace
    empty = SimpleNamespace(outputs=[SimpleNamespace(token_ids=[], text="", logprobs=None)])
    return [last.get(rid, empty) for rid in ids]   # aborted before its first token: nothing


def _child_env(env: dict | None) -> dict:
    """This process's environment + ENGINE_ENV + `env`; a None value in `env` removes the name."""
    out = {k: v for k, v in {**os.environ, **ENGINE_ENV, **(env or {})}.items() if v is not None}
    out.setdefault("OMP_NUM_THREADS", "1")
    return out


def run_isolated(job: dict, env: dict | None = None, timeout: float = 1800) -> dict:
    """`run(job)` in a fresh Python process; raises with the child's stderr tail on failure."""
    p = subprocess.run([sys.executable, "-m", "vllm_spec_plugins.tools.runner"], input=json.dumps(job),
                       capture_output=True, text=True, env=_child_env(env), timeout=timeout)
    marker = "\n" + _MARK
    if p.returncode != 0 or marker not in p.stdout:
        raise RuntimeError(f"engine run failed (rc={p.returncode}):\n{p.stderr[-4000:]}")
    # worker processes (tensor parallel) may still print at shutdown: read the one JSON object
    return json.JSONDecoder().raw_decode(p.stdout.split(marker, 1)[1])[0]


class EngineProcess:
    """`run`'s engine in its own process, kept up between calls: `group(name, rows)` serves one
    prompt set and returns its measurements (as `run`'s groups), `finish()` the rest of `run`'s
    result. scripts/bench.py --interleave keeps one per method and serves each a turn in rotation,
    so this host's drifting speed hits every method alike."""

    def __init__(self, job: dict, env: dict | None = None):
        import tempfile
        self.err = tempfile.TemporaryFile(mode="w+")
        self.p = subprocess.Popen([sys.executable, "-m", "vllm_spec_plugins.tools.runner", "--serve"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err,
                                  text=True, env=_child_env(env))
        try:
            self._call(job)
        except BaseException:               # interrupted mid start-up: nothing will ever read it
            self.kill()
            raise

    def _call(self, msg: dict) -> dict:
        try:
            self.p.stdin.write(json.dumps(msg) + "\n")
            self.p.stdin.flush()
            for line in self.p.stdout:          # vLLM may log to stdout: skip to our line
                if line.startswith(_MARK):
                    return json.loads(line[len(_MARK):])
        except BrokenPipeError:
            pass
        self.close()
        self.err.seek(0)
        raise RuntimeError(f"engine process failed (rc={self.p.returncode}):\n{self.err.read()[-4000:]}")

    def group(self, name: str, rows: list) -> dict:
        return self._call({"group": name, "rows": rows})

    def start(self, name: str, rows: list) -> None:
        """Queue a prompt set; `step` runs it one engine step at a time, `done` measures it."""
        self._call({"start": name, "rows": rows})

    def step(self) -> dict:
        return self._call({"step": True})

    def done(self) -> dict:
        return self._call({"done": True})

    def finish(self) -> dict:
        out = self._call({"finish": True})
        self.close()
        return out

    def kill(self) -> None:
        """Stop the process now (SIGTERM: vLLM takes its own engine process down)."""
        self._end(self.p.terminate, 30)

    def close(self) -> None:
        """Let the process finish (its stdin closed, it exits)."""
        self._end(self.p.stdin.close, 60)

    def _end(self, ask, seconds: float) -> None:
        """`ask` a running process to end; SIGKILL if it has not within `seconds`."""
        if self.p.poll() is None:
            ask()
            try:
                self.p.wait(seconds)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()


class PausedClock:
    """`time.perf_counter` less the seconds this process spent waiting for its parent: with
    engines run in lockstep (`EngineProcess.step`), each engine's clocks (vLLM's, the plugin's
    step-cost and tokens/s measurements) see its own steps back to back, as if it ran alone."""

    def __init__(self, real=time.perf_counter):
        self.real, self.paused = real, 0.0

    def __call__(self) -> float:
        return self.real() - self.paused

    def wait(self, read):
        t0 = self.real()
        try:
            return read()
        finally:
            self.paused += self.real() - t0


def _serve() -> None:
    """The child side of `EngineProcess`: a job line, then {"group", "rows"} lines (or
    {"start", "rows"}, {"step"}..., {"done"}), then {"finish"}. A job with "lockstep" runs under
    a `PausedClock`, installed before vLLM or the plugin is imported."""
    def reply(obj):
        sys.stdout.write("\n" + _MARK + json.dumps(obj) + "\n")
        sys.stdout.flush()
    job = json.loads(sys.stdin.readline())
    read = sys.stdin.readline
    if job.get("lockstep"):
        clock = time.perf_counter = PausedClock()
        read = lambda: clock.wait(sys.stdin.readline)      # noqa: E731
    eng = _Engine(job)
    reply({"startup_s": eng.result["startup_s"]})
    for line in iter(read, ""):
        msg = json.loads(line)
        if msg.get("finish"):
            reply(eng.finish())
            return
        if msg.get("step"):
            reply(eng.step())
        elif "start" in msg:
            eng.start(msg["start"], msg["rows"])
            reply({})
        elif msg.get("done"):
            reply(eng.done())
        else:
            reply(eng.group(msg["group"], msg["rows"]))


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        _serve()
    else:
        res = run(json.loads(sys.stdin.read()))
        sys.stdout.write("\n" + _MARK + json.dumps(res))
