"""Ray on this CPU machine (vLLM's Ray executor refuses the CPU platform, so its GPU path is
checked as far as a CPU allows):
* a local Ray cluster (head started by `ray.init` on 127.0.0.1, stopped at the end) serving two
  speculating replicas as Ray actors behind one router: 32 concurrent greedy requests equal a
  plain single engine's outputs; no Ray/vLLM process or temp dir left behind;
* vLLM's own Ray worker (`RayWorkerWrapper`, what its Ray executor starts on every GPU) loads
  our plugin in `init_worker` and receives our method's parameters."""
import os
import shutil
import subprocess
import tempfile
import time

import pytest

from vllm_spec_plugins.tools.runner import run_isolated

pytestmark = pytest.mark.slow
MAX_TOKENS = 24
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1",
              "OMP_WAIT_POLICY": "PASSIVE", "TOKENIZERS_PARALLELISM": "false",
              "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}


def _procs_matching(text: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if text in line and "ps -eo" not in line]


def _tmp_entries() -> set[str]:
    """Top-level /tmp entries, minus pytest's and this machine's tool folders."""
    return {n for n in os.listdir("/tmp") if not n.startswith(("pytest-of-", "bash_jobs"))}


@pytest.fixture(scope="module")
def ray_cluster():
    import ray
    before = _tmp_entries()
    tmp = tempfile.mkdtemp(prefix="rvsp", dir="/tmp")     # short: Ray's socket paths are length-limited
    # ray.init starts the head (GCS, raylet) as its own children: `ray start` + ray.init(address)
    # rewrites 127.0.0.1 to the host's routable IP, which a sandbox may not let us connect to
    ray.init(_node_ip_address="127.0.0.1", num_cpus=4, include_dashboard=False, _temp_dir=tmp,
             logging_level="WARNING")
    try:
        yield tmp
    finally:
        ray.shutdown()
        deadline = time.time() + 30
        while _procs_matching(tmp) and time.time() < deadline:
            time.sleep(0.5)
        left = _procs_matching(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        assert not left, f"Ray processes left behind: {left}"
        new = _tmp_entries() - before
        assert not new, f"files left in /tmp: {sorted(new)[:10]}"


def test_two_speculating_replicas_32_concurrent_requests(ray_cluster, default_model):
    from vllm_spec_plugins.ray_replicas import ReplicaRouter
    from vllm_spec_plugins.tools.data import make_prompts
    rows = make_prompts(categories=("chat", "code"), n_per_category=16, split="heldout")
    plain = run_isolated({"model": default_model, "groups": {"all": rows}, "max_tokens": MAX_TOKENS,
                          "temperature": 0.0, "batch_size": 32, "dtype": "float32", "max_model_len": 2048,
                          "llm_kwargs": {"enforce_eager": True}})["groups"]["all"]
    prompts = plain["prompt_token_ids"]
    before = set(_procs_matching("VLLM::EngineCore"))
    # vLLM's engine processes put zmq sockets (and other temp files) under VLLM_RPC_BASE_PATH /
    # TMPDIR: keep them in the cluster's private folder, removed at the end
    env = {**ENGINE_ENV, "VLLM_RPC_BASE_PATH": ray_cluster, "TMPDIR": ray_cluster}
    router = ReplicaRouter.start(default_model, {"method": "bandit_tree", "num_speculative_tokens": 8},
                                 replicas=2, env=env,
                                 engine_kwargs={"dtype": "float32", "max_model_len": 2048,
                                                "enforce_eager": True, "max_num_seqs": 16})
    try:
        outs = router.generate_many(prompts, {"max_tokens": MAX_TOKENS, "temperature": 0.0})
        counters = router.spec_counters()
    finally:
        router.shutdown()
    assert len(outs) == 32
    for i, (o, ref) in enumerate(zip(outs, plain["outputs"])):
        assert o["token_ids"] == ref[0], f"request {i} differs from a plain single engine"
    assert len({o["replica"] for o in outs}) == 2, "both replicas must serve"
    assert all(c["drafts"] > 0 for c in counters), counters     # both really speculated
    deadline = time.time() + 30
    while set(_procs_matching("VLLM::EngineCore")) - before and time.time() < deadline:
        time.sleep(0.5)
    assert not set(_procs_matching("VLLM::EngineCore")) - before, "engine processes left behind"


def test_vllm_ray_worker_loads_plugin_and_config(ray_cluster, tiny_model):
    import cloudpickle
    import ray
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.executor.ray_utils import RayWorkerWrapper

    from vllm_spec_plugins.ray_replicas import PLUGIN_ENV, worker_plugin_report
    vc = EngineArgs(model=tiny_model, dtype="float32", max_model_len=512,
                    speculative_config={"method": "bandit_tree", "num_speculative_tokens": 8,
                                        "max_width": 2, "scope": "field:tenant"}).create_engine_config()
    env = {**PLUGIN_ENV, **ENGINE_ENV, "VLLM_RPC_BASE_PATH": ray_cluster, "TMPDIR": ray_cluster}
    worker = ray.remote(RayWorkerWrapper).options(num_cpus=1, runtime_env={"env_vars": env}).remote(rpc_rank=0)
    try:
        ray.get(worker.init_worker.remote([{"vllm_config": vc, "local_rank": 0, "rank": 0,
                                            "distributed_init_method": "tcp://127.0.0.1:0",
                                            "is_driver_worker": True}]))
        got = ray.get(worker.execute_method.remote(cloudpickle.dumps(worker_plugin_report)))
    finally:
        ray.kill(worker)
    assert got["pid"] != os.getpid()
    assert got["patched"] and got["runner_hooked"]
    assert (got["method"], got["model"]) == ("custom_class", "vllm_spec_plugins.proposer.PluginProposer")
    assert got["params"]["method"] == "bandit_tree" and got["params"]["scope"] == "field:tenant"
