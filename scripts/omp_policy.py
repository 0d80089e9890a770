"""Plain vLLM's CPU decode speed under each OpenMP wait policy, with and without numba's OpenMP
pool loaded (vLLM's `ngram` loads it), each in a fresh process:

    python scripts/omp_policy.py [--prompts 8] [--max-tokens 64] [--threads 2] [--json out.json]

Prints tokens/s and the process's user / system seconds per variant. Why it exists: the
benchmark's engines once ran under OMP_WAIT_POLICY=PASSIVE, which cost plain vLLM ~40% of its
batch-1 decode speed on a 2-core host.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

VARIANTS = [(policy, numba) for policy in ("PASSIVE", None, "ACTIVE") for numba in (False, True)]


def _child(prompts: int, max_tokens: int, numba: bool) -> dict:
    from vllm import LLM, SamplingParams

    from vllm_spec_plugins.tools.models import default_model_dir
    llm = LLM(model=str(default_model_dir()), dtype="bfloat16", enforce_eager=True, max_num_seqs=1,
              max_model_len=2048, seed=0)
    if numba:   # what vLLM's NgramProposer does at start-up: one parallel numba call
        import numpy as np
        from numba import njit, prange

        @njit(parallel=True)
        def touch(a):
            for i in prange(a.shape[0]):
                a[i] += 1
        touch(np.zeros(8))
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    texts = [f"Write a short story about a {w} who learns to code." for w in
             ("cat", "dog", "robot", "pirate", "farmer", "wizard", "child", "teacher")]
    llm.generate(texts[:1], sp, use_tqdm=False)      # warm-up
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    n = sum(len(llm.generate([texts[i % len(texts)]], sp, use_tqdm=False)[0].outputs[0].token_ids)
            for i in range(prompts))
    dt, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    return {"tokens_per_s": n / dt, "user_s": r1.ru_utime - r0.ru_utime, "sys_s": r1.ru_stime - r0.ru_stime,
            "tokens": n}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print("@@" + json.dumps(_child(a.prompts, a.max_tokens, a.child == "numba")), flush=True)
        return
    from tqdm import tqdm

    from vllm_spec_plugins.tools.runner import _child_env
    rows = []
    for policy, numba in tqdm(VARIANTS, desc="variants", unit="engine"):
        env = _child_env({"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": str(a.threads),
                          "OMP_WAIT_POLICY": policy})      # None: the runtime's default
        out = subprocess.run([sys.executable, __file__, "--child", "numba" if numba else "plain",
                              "--prompts", str(a.prompts), "--max-tokens", str(a.max_tokens)],
                             env=env, capture_output=True, text=True)
        line = next((x for x in out.stdout.splitlines() if x.startswith("@@")), None)
        if line is None:
            raise SystemExit(f"variant {policy}/{numba} failed:\n{out.stderr[-3000:]}")
        rows.append({"omp_wait_policy": policy or "default", "numba_pool": numba, **json.loads(line[2:])})
    print("| OMP_WAIT_POLICY | numba pool | tok/s | user s | sys s |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['omp_wait_policy']} | {'yes' if r['numba_pool'] else 'no'} | {r['tokens_per_s']:.1f} "
              f"| {r['user_s']:.1f} | {r['sys_s']:.2f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows, "args": vars(a)}, f, indent=1)


if __name__ == "__main__":
    main()
