"""Replicas of a speculating vLLM engine as Ray actors, behind one entry point.

    router = ReplicaRouter.start(model, {"method": "lookahead"}, replicas=2)
    outs = router.generate_many(prompt_token_ids, {"max_tokens": 64, "temperature": 0})
    router.shutdown()

Each replica is an async Ray actor holding one `AsyncLLM` (vLLM's serving engine): requests sent
to it concurrently are batched by vLLM's scheduler. The router deals requests out round-robin.
Nothing of ours has to be shipped by hand: vLLM loads its general plugins (our `register`) in
every process it starts, and the actor's `runtime_env` carries `VLLM_PLUGINS` and the engine's
environment. Where vLLM's own Ray executor runs (GPUs; it refuses vLLM's CPU platform), tensor
parallelism inside a replica is vLLM's business:
`engine_kwargs={"tensor_parallel_size": N, "distributed_executor_backend": "ray"}`; every
worker loads the plugin in `WorkerWrapperBase.init_worker` (tests/test_ray.py checks that path).
"""
from __future__ import annotations

import os
import threading

PLUGIN_ENV = {"VLLM_PLUGINS": "vllm_spec_plugins"}


def _actor_class():
    import ray

    @ray.remote
    class EngineReplica:
        def __init__(self, model: str, speculative_config: dict | None, engine_kwargs: dict):
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
            args = AsyncEngineArgs(model=model, speculative_config=speculative_config,
                                   disable_log_stats=False, **engine_kwargs)
            self.engine = AsyncLLM.from_engine_args(args)
            self.n = 0

        async def generate(self, prompt_token_ids: list[int], sampling: dict) -> dict:
            from vllm import SamplingParams
            from vllm.inputs import TokensPrompt
            self.n += 1
            rid = f"{os.getpid()}-{self.n}"
            final = None
            async for out in self.engine.generate(TokensPrompt(prompt_token_ids=prompt_token_ids),
                                                  SamplingParams(**sampling), rid):
                final = out
            return {"token_ids": list(final.outputs[0].token_ids), "text": final.outputs[0].text,
                    "replica": os.getpid()}

        async def spec_counters(self) -> dict:
            """vLLM's own spec-decode counters of this replica (drafts, accepted tokens)."""
            from vllm.v1.metrics.reader import get_metrics_snapshot
            names = {"vllm:spec_decode_num_drafts": "drafts",
                     "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                     "vllm:spec_decode_num_accepted_tokens": "accepted"}
            out = dict.fromkeys(names.values(), 0)
            for m in get_metrics_snapshot():
                if m.name in names:
                    out[names[m.name]] += int(m.value)
            return out

        async def shutdown(self) -> None:
            self.engine.shutdown()

    return EngineReplica


class ReplicaRouter:
    """Round-robin routing over replica actors (thread-safe): with equal replicas and requests
    arriving concurrently, each replica's vLLM scheduler batches its share."""

    def __init__(self, actors: list):
        self.actors = actors
        self.next = 0
        self.lock = threading.Lock()

    @classmethod
    def start(cls, model: str, speculative_config: dict | None, replicas: int = 2,
              engine_kwargs: dict | None = None, env: dict | None = None,
              num_cpus: float = 1) -> "ReplicaRouter":
        """`replicas` actors on the connected Ray cluster (call `ray.init` first); returns once
        every engine is up. `env`: extra environment for the actors (e.g. VLLM_CPU_KVCACHE_SPACE)."""
        import ray
        EngineReplica = _actor_class()
        runtime_env = {"env_vars": {**PLUGIN_ENV, **(env or {})}}
        actors = [EngineReplica.options(num_cpus=num_cpus, runtime_env=runtime_env)
                  .remote(model, speculative_config, engine_kwargs or {}) for _ in range(replicas)]
        ray.get([a.__ray_ready__.remote() for a in actors])
        return cls(actors)

    def submit(self, prompt_token_ids: list[int], sampling: dict):
        """One request -> an ObjectRef of {"token_ids", "text", "replica"}."""
        with self.lock:
            i, self.next = self.next, (self.next + 1) % len(self.actors)
        return self.actors[i].generate.remote(prompt_token_ids, sampling)

    def generate_many(self, prompts: list[list[int]], sampling: dict) -> list[dict]:
        import ray
        return ray.get([self.submit(p, sampling) for p in prompts])

    def spec_counters(self) -> list[dict]:
        import ray
        return ray.get([a.spec_counters.remote() for a in self.actors])

    def shutdown(self) -> None:
        import ray
        try:
            ray.get([a.shutdown.remote() for a in self.actors], timeout=60)
        finally:
            for a in self.actors:
                ray.kill(a)


def worker_plugin_report(wrapper) -> dict:
    """Run inside a vLLM worker wrapper (e.g. `RayWorkerWrapper.execute_method(cloudpickle.dumps(
    worker_plugin_report))`): whether our plugin is registered and hooked in that process, and the
    speculative config the worker received."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_spec_plugins import _compat
    from vllm_spec_plugins.config import ADDITIONAL_KEY
    vc = wrapper.worker.vllm_config
    return {"patched": _compat._patched,
            "runner_hooked": GPUModelRunner.propose_draft_token_ids.__code__.co_filename.endswith(
                os.path.join("vllm_spec_plugins", "patches", "model_runner.py")),
            "method": vc.speculative_config.method, "model": vc.speculative_config.model,
            "params": (vc.additional_config or {}).get(ADDITIONAL_KEY), "pid": os.getpid()}
