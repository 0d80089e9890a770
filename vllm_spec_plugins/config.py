"""Our method names and keys -> vLLM's `custom_class` door. Validated before the engine starts.

    {"method": "lookahead", "num_speculative_tokens": 6, "window": 6, "ngram": 4, "guesses": 7}
becomes
    speculative_config = {"method": "custom_class", "model": PROPOSER_PATH, "num_speculative_tokens": 6}
    additional_config["vllm_spec_plugins"] = {"method": "lookahead", "num_speculative_tokens": 6, ...}
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ADDITIONAL_KEY = "vllm_spec_plugins"
PROPOSER_PATH = "vllm_spec_plugins.proposer.PluginProposer"


@dataclass(frozen=True)
class Key:
    default: Any
    lo: float | None = None
    hi: float | None = None
    kind: type = int
    help: str = ""


GOODPUT = Key(True, kind=bool, help="per step, keep only the draft tokens whose learned chance of acceptance "
              "pays for their measured verification cost, over the whole batch; draft nothing while drafting "
              "does not pay (false: always draft num_speculative_tokens)")

# method -> {key: Key}. `num_speculative_tokens` is vLLM's own key; the rest are ours.
METHODS: dict[str, dict[str, Key]] = {
    "lookahead": {
        "num_speculative_tokens": Key(6, 1, 64, int, "max draft chain length (k)"),
        "window": Key(0, 0, 64, int, "Jacobi window W (guess positions; 0 = num_speculative_tokens)"),
        "ngram": Key(4, 2, 16, int, "n-gram size N (lookahead levels + 1)"),
        "guesses": Key(7, 1, 64, int, "G: max n-gram candidates kept per key token"),
        "pool_cap": Key(4096, 16, 1 << 20, int, "max n-grams per request (LRU eviction)"),
        "shared_pool": Key(65536, 0, 1 << 22, int, "contexts kept in the n-gram table shared by all requests "
                           "(every request's prompt and output; LRU), kept apart per tenant: requests with "
                           "another cache_salt never draft from each other's text; 0 = off (each request "
                           "drafts from its own text only)"),
        "prompt_lookup_min": Key(1, 1, 16, int, "prompt-lookup fallback: min match length"),
        "prompt_lookup_max": Key(3, 1, 16, int, "prompt-lookup fallback: max match length"),
        "tree": Key(False, kind=bool, help="full form: verify pool candidates + Jacobi window as one tree"),
        "tree_nodes": Key(0, 0, 64, int, "tree node budget (0 = num_speculative_tokens)"),
        "goodput": GOODPUT,
    },
    "bandit_tree": {
        "num_speculative_tokens": Key(16, 1, 64, int, "draft tokens the scheduler reserves per request (>= node_budget)"),
        "drafter": Key("lookahead", kind=str, help="what proposes candidates per depth: 'lookahead' (model-free pool) "
                       "or 'mamba' (the Mamba drafter's greedy chain and its next-best tokens per depth)"),
        "model": Key("", kind=str, help="drafter 'mamba': its folder (`python -m vllm_spec_plugins.drafters --drafter "
                     "mamba`) or 'vllm_spec_plugins:smollm2-135m-instruct-mamba' (shipped)"),
        "node_budget": Key(0, 0, 64, int, "max tree nodes per request (0 = num_speculative_tokens)"),
        "max_depth": Key(6, 1, 64, int, "deepest shape in the generated family"),
        "max_width": Key(4, 1, 64, int, "widest first level in the generated family"),
        "shapes": Key([], kind=list, help="explicit shape family: list of width lists ([] in it = no speculation); one shape = fixed"),
        "batch_node_budget": Key(64, 1, 1 << 16, int, "draft nodes per step across the batch: shapes over budget/batch_size nodes are not tried"),
        "backoff": Key(True, kind=bool, help="include the no-speculation arm in the generated family"),
        "scope": Key("global", kind=str, help="bandit tables: 'global', 'request', or 'field:NAME' (SamplingParams.extra_args[NAME])"),
        "exploration": Key(0.05, 0.0, 10.0, float, "UCB exploration weight c (times the best mean reward)"),
        "discount": Key(0.995, 0.5, 1.0, float, "per-step discount of the bandit's counts (memory ~ 1/(1-discount) steps)"),
        "window": Key(0, 0, 64, int, "drafter: Jacobi window W (0 = deepest shape)"),
        "ngram": Key(4, 2, 16, int, "drafter: n-gram size N"),
        "guesses": Key(7, 1, 64, int, "drafter: n-gram candidates kept per key token"),
        "pool_cap": Key(4096, 16, 1 << 20, int, "drafter: max n-grams per request (LRU eviction)"),
        "shared_pool": Key(65536, 0, 1 << 22, int, "drafter: contexts kept in the n-gram table shared by all "
                           "requests (lookahead's `shared_pool`; 0 = off; unused with drafter 'mamba')"),
        "prompt_lookup_min": Key(1, 1, 16, int, "drafter: prompt-lookup min match length"),
        "prompt_lookup_max": Key(3, 1, 16, int, "drafter: prompt-lookup max match length"),
    },
    "mamba": {
        "num_speculative_tokens": Key(4, 1, 16, int, "draft chain length (k)"),
        "model": Key(None, kind=str, help="Mamba drafter folder made by `python -m vllm_spec_plugins.drafters "
                     "--drafter mamba`, or 'vllm_spec_plugins:smollm2-135m-instruct-mamba' (shipped)"),
        "goodput": GOODPUT,
    },
    "cascade": {
        "num_speculative_tokens": Key(8, 1, 16, int, "max drafts handed to the target per step"),
        "levels": Key(["ngram", "mamba"], kind=list, help="draft levels, cheapest first; each drafts for the "
                      "next, the last for the target: ['ngram', 'mamba'] (level 0: n-gram lookup in the "
                      "request's own tokens) or ['lookahead', 'mamba'] (level 0: lookahead's chain form: "
                      "its text index, its pool of n-grams from the target's own outputs, the shared pool)"),
        "model": Key(None, kind=str, help="the 'mamba' level's drafter folder (`python -m vllm_spec_plugins.drafters "
                     "--drafter mamba`) or 'vllm_spec_plugins:smollm2-135m-instruct-mamba' (shipped)"),
        "drafter_steps": Key(3, 0, 16, int, "sequential drafter steps after its one-pass check of the n-gram level"),
        "drafter_top_k": Key(0, 0, 64, int, "the drafter keeps an n-gram token it ranks in its top k (1: only its own greedy choice; 0: all)"),
        "prompt_lookup_min": Key(1, 1, 16, int, "n-gram level: min match length"),
        "prompt_lookup_max": Key(3, 1, 16, int, "n-gram level: max match length"),
        "shared_pool": Key(65536, 0, 1 << 22, int, "'lookahead' level: contexts kept in the n-gram table shared "
                           "by all requests (0 = off)"),
        "goodput": GOODPUT,
    },
    # Test proposers: drafts from a reference file {prompt ids -> plain greedy output ids}.
    "oracle": {
        "num_speculative_tokens": Key(4, 1, 64, int, "draft chain length / tree node budget"),
        "references": Key(None, kind=str, help="JSON file: [[prompt_ids, output_ids], ...]"),
        "tree_nodes": Key(0, 0, 64, int, "0: chain drafts; else a random tree of this many nodes"),
        "tree_depth": Key(3, 1, 64, int, "depth of the true branch hidden in the tree"),
        "check_hidden_states": Key(False, kind=bool, help="test: check the target hidden states handed to the proposer"),
    },
    "adversarial": {
        "num_speculative_tokens": Key(4, 1, 64, int, "draft chain length / tree node budget"),
        "references": Key("", kind=str, help="JSON file: [[prompt_ids, output_ids], ...]; empty: draft token vocab-1 (wrong unless the target emits it)"),
        "tree_nodes": Key(0, 0, 64, int, "0: chain drafts; else a random tree of this many nodes"),
        "tree_depth": Key(3, 1, 64, int, "depth of the true branch hidden in the tree"),
        "check_hidden_states": Key(False, kind=bool, help="test: check the target hidden states handed to the proposer"),
        "alternate": Key(False, kind=bool, help="bench: alternate a chain of num_speculative_tokens and a tree of "
                         "tree_nodes every step, timing each kind of verification step"),
        "cycle": Key([], kind=list, help="bench: chain lengths (0 = no drafts) drafted in turn, one per step, "
                     "timing the steps that verify each"),
    },
}
# vLLM SpeculativeConfig keys users may still set next to ours.
PASSTHROUGH = ("enforce_eager", "disable_padded_drafter_batch", "num_speculative_tokens_per_batch_size")


def _vllm_methods() -> tuple[str, ...]:
    from typing import get_args

    from vllm.config.speculative import SpeculativeMethod

    def flat(t):
        for a in get_args(t):
            yield from (flat(a) if get_args(a) else [a])
    return tuple(flat(SpeculativeMethod))


def fold_cli_flags(engine_args) -> dict | None:
    """Merge --spec-method/--spec-tokens into the dict when the method is ours (vLLM does the rest)."""
    spec = engine_args.speculative_config
    method = getattr(engine_args, "spec_method", None)
    if method in METHODS:
        spec = dict(spec or {})
        for flag, key, value in (("--spec-method", "method", method),
                                 ("--spec-model", "model", getattr(engine_args, "spec_model", None)),
                                 ("--spec-tokens", "num_speculative_tokens", getattr(engine_args, "spec_tokens", None))):
            if value is None:
                continue
            if key in spec:
                raise ValueError(f"{flag} and --speculative-config['{key}'] are mutually exclusive")
            spec[key] = value
        engine_args.spec_method = engine_args.spec_model = engine_args.spec_tokens = None
        engine_args.speculative_config = spec
    if isinstance(spec, dict):
        method = spec.get("method")
        if method is not None and method not in METHODS:
            allowed = sorted(set(_vllm_methods()) | set(METHODS) - {"oracle", "adversarial"})
            if method not in allowed:
                raise ValueError(f"speculative_config.method={method!r} is unknown; allowed: "
                                 + ", ".join(allowed))
    return spec


def is_plugin_config(spec) -> bool:
    return isinstance(spec, dict) and (spec.get("method") in METHODS)


def validate(spec: dict) -> dict:
    """Checked, defaulted parameters of one of our methods; ValueError naming the field otherwise."""
    spec = {k.replace("-", "_"): v for k, v in spec.items()}
    method = spec.get("method")
    keys = METHODS[method]
    unknown = set(spec) - set(keys) - set(PASSTHROUGH) - {"method"}
    if "backoff" in unknown:
        raise ValueError(f"speculative_config.backoff is gone for method {method!r}: goodput (on by default) "
                         "decides per step and per token what pays; remove the key, or set goodput: false "
                         "to always draft num_speculative_tokens")
    if unknown:
        raise ValueError(f"unknown key(s) {sorted(unknown)} in speculative_config for method "
                         f"{method!r}; allowed keys: {', '.join(sorted(set(keys) | set(PASSTHROUGH)))}")
    out: dict[str, Any] = {"method": method}
    for name, key in keys.items():
        v = spec.get(name, key.default)
        if v is None:
            if key.default is None:
                raise ValueError(f"speculative_config.{name} is required for method {method!r} ({key.help})")
            continue
        if key.kind is int and (isinstance(v, bool) or not isinstance(v, int)):
            raise ValueError(f"speculative_config.{name}={v!r} must be an integer ({key.help})")
        if key.kind is bool and not isinstance(v, bool):
            raise ValueError(f"speculative_config.{name}={v!r} must be true or false ({key.help})")
        if key.kind is str and not isinstance(v, str):
            raise ValueError(f"speculative_config.{name}={v!r} must be a string ({key.help})")
        if key.kind is float:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ValueError(f"speculative_config.{name}={v!r} must be a number ({key.help})")
            v = float(v)
        if key.kind is list and not isinstance(v, list):
            raise ValueError(f"speculative_config.{name}={v!r} must be a list ({key.help})")
        if key.lo is not None and not (key.lo <= v <= key.hi):
            raise ValueError(f"speculative_config.{name}={v} is out of range for method {method!r}: "
                             f"allowed {key.lo}..{key.hi} ({key.help})")
        out[name] = v
    if "prompt_lookup_min" in out and out["prompt_lookup_min"] > out["prompt_lookup_max"]:
        raise ValueError("speculative_config.prompt_lookup_min must be <= prompt_lookup_max")
    if method == "lookahead":
        out["window"] = out["window"] or out["num_speculative_tokens"]
        out["tree_nodes"] = out["tree_nodes"] or out["num_speculative_tokens"]
        if out["tree_nodes"] > out["num_speculative_tokens"]:
            raise ValueError(f"speculative_config.tree_nodes={out['tree_nodes']} must be <= "
                             f"num_speculative_tokens={out['num_speculative_tokens']} (the scheduler's draft budget)")
        if out["window"] > out["num_speculative_tokens"]:
            raise ValueError(f"speculative_config.window={out['window']} must be <= "
                             f"num_speculative_tokens={out['num_speculative_tokens']}")
        if out["ngram"] > out["num_speculative_tokens"] + 1:
            raise ValueError(f"speculative_config.ngram={out['ngram']} must be <= "
                             f"num_speculative_tokens + 1 = {out['num_speculative_tokens'] + 1}")
    if method == "bandit_tree":
        _check_bandit(out)
    if method in ("oracle", "adversarial") and out["tree_nodes"] and not out["tree_depth"] <= out["tree_nodes"] <= out["num_speculative_tokens"]:
        raise ValueError("speculative_config: need tree_depth <= tree_nodes <= num_speculative_tokens")
    if out.get("cycle") and not (len(out["cycle"]) >= 2 and all(
            isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= out["num_speculative_tokens"]
            for x in out["cycle"]) and len(set(out["cycle"])) == len(out["cycle"])):
        raise ValueError(f"speculative_config.cycle={out['cycle']!r}: give >= 2 distinct chain lengths, "
                         f"each 0..num_speculative_tokens={out['num_speculative_tokens']}")
    if out.get("alternate") and not out["tree_nodes"]:
        raise ValueError("speculative_config.alternate needs tree_nodes (the tree it alternates with the chain)")
    if method == "mamba":
        _check_ssm_drafter(out["model"])
    if method == "cascade":
        if out["levels"] not in (["ngram", "mamba"], ["lookahead", "mamba"]):
            raise ValueError(f"speculative_config.levels={out['levels']!r}: this release runs the cascades "
                             "['ngram', 'mamba'] and ['lookahead', 'mamba'] (a model-free level drafts for "
                             "the Mamba drafter, which drafts for the target)")
        _check_ssm_drafter(out["model"], method)
    if out.get("references"):
        _check_readable(out["references"], "references")
    return out


def _check_bandit(out: dict) -> None:
    k = out["num_speculative_tokens"]
    budget = out["node_budget"] = out["node_budget"] or k
    if budget > k:
        raise ValueError(f"speculative_config.node_budget={budget} must be <= num_speculative_tokens={k} "
                         "(the scheduler's draft budget)")
    for name in ("max_depth", "max_width"):
        if out[name] > budget:
            raise ValueError(f"speculative_config.{name}={out[name]} must be <= node_budget={budget}")
    if out["drafter"] not in ("lookahead", "mamba"):
        raise ValueError(f"speculative_config.drafter={out['drafter']!r}: bandit_tree drafts candidates with "
                         "'lookahead' (model-free) or 'mamba' (a Mamba drafter, speculative_config.model)")
    if out["drafter"] == "mamba":
        if not out["model"]:
            raise ValueError("speculative_config.model is required with drafter 'mamba' (a folder made by "
                             "python -m vllm_spec_plugins.drafters --drafter mamba, or "
                             "'vllm_spec_plugins:smollm2-135m-instruct-mamba')")
        _check_ssm_drafter(out["model"], "bandit_tree")
    elif out["model"]:
        raise ValueError(f"speculative_config.model={out['model']!r} is only used with drafter 'mamba' "
                         "(drafter 'lookahead' is model-free)")
    scope = out["scope"]
    if not (scope in ("global", "request") or (scope.startswith("field:") and len(scope) > 6)):
        raise ValueError(f"speculative_config.scope={scope!r} must be 'global', 'request' or 'field:NAME'")
    for s in out["shapes"]:
        if not isinstance(s, list) or not all(isinstance(w, int) and not isinstance(w, bool) and w >= 1 for w in s):
            raise ValueError(f"speculative_config.shapes: each shape is a list of widths >= 1 (nodes per depth), got {s!r}")
        if sum(s) > budget:
            raise ValueError(f"speculative_config.shapes: shape {s} has {sum(s)} nodes > node_budget={budget}")
    if out["window"] > k:
        raise ValueError(f"speculative_config.window={out['window']} must be <= num_speculative_tokens={k}")
    if out["ngram"] > k + 1:
        raise ValueError(f"speculative_config.ngram={out['ngram']} must be <= num_speculative_tokens + 1 = {k + 1}")


def _check_ssm_drafter(path: str, method: str = "mamba") -> None:
    import json
    import os
    marker = os.path.join(path, "drafter.json")
    if not os.path.isdir(path):
        raise ValueError(f"speculative_config.model={path!r} does not exist or is not a folder "
                         "(make one with: python -m vllm_spec_plugins.drafters --drafter mamba)")
    for f in ("drafter.json", "config.json", "model.safetensors"):
        if not os.access(os.path.join(path, f), os.R_OK):
            raise ValueError(f"speculative_config.model={path!r} has no readable {f}: not a drafter "
                             "made by python -m vllm_spec_plugins.drafters --drafter mamba")
    for f in ("drafter.json", "config.json"):
        try:
            with open(os.path.join(path, f)) as fh:
                meta = json.load(fh)
            if not isinstance(meta, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            raise ValueError(f"speculative_config.model={path!r}: {os.path.join(path, f)} is corrupt "
                             f"({e}); re-export the drafter") from None
        if f == "drafter.json":
            kind = meta.get("kind")
    weights = os.path.join(path, "model.safetensors")
    try:
        from safetensors import safe_open
        with safe_open(weights, "pt") as fh:
            fh.keys()
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise ValueError(f"speculative_config.model={path!r}: {weights} is corrupt ({e}); "
                         "re-export the drafter") from None
    if kind != "mamba":
        raise ValueError(f"speculative_config.model={path!r} is a {kind!r} drafter; method {method!r} "
                         "runs drafters of kind 'mamba'")


def _check_readable(path: str, field: str) -> None:
    import os
    if not os.path.exists(path):
        raise ValueError(f"speculative_config.{field}={path!r} does not exist")
    if not os.access(path, os.R_OK):
        raise ValueError(f"speculative_config.{field}={path!r} is not readable")


def check_drafter(path: str, target_dir: str, field: str = "drafter") -> None:
    """A drafter folder must exist, be a readable model folder, and share the target's tokenizer
    (same vocab size and token->id map). Raises ValueError naming `field` otherwise."""
    import os

    from vllm_spec_plugins.models import same_tokenizer
    if not isinstance(path, str) or not path:
        raise ValueError(f"speculative_config.{field} must be a model folder path")
    if not os.path.isdir(path):
        raise ValueError(f"speculative_config.{field}={path!r} does not exist or is not a folder")
    cfg = os.path.join(path, "config.json")
    if not os.access(cfg, os.R_OK):
        raise ValueError(f"speculative_config.{field}={path!r} has no readable config.json")
    ok, reason = same_tokenizer(path, target_dir)
    if not ok:
        raise ValueError(f"speculative_config.{field}={path!r} does not match the target's "
                         f"tokenizer: {reason}")


SHIPPED_PREFIX = "vllm_spec_plugins:"


def resolve_shipped_drafter(spec):
    """`"model": "vllm_spec_plugins:NAME"` -> the folder of drafter NAME shipped in this package
    (for YAML drop-ins, which cannot compute a site-packages path). Returns the (new) spec."""
    model = spec.get("model") if isinstance(spec, dict) else None
    if not (isinstance(model, str) and model.startswith(SHIPPED_PREFIX)):
        return spec
    from vllm_spec_plugins.drafters import shipped_drafter
    try:
        path = shipped_drafter(model[len(SHIPPED_PREFIX):])
    except FileNotFoundError as e:
        raise ValueError(f"speculative_config.model={model!r}: {e}") from None
    return {**spec, "model": str(path)}


def check_drafter_marker(spec, target_dir: str) -> None:
    """vLLM's own `eagle` / `draft_model` pointed at a drafter exported by
    `vllm_spec_plugins.drafters` (a folder with drafter.json): refuse it, before the engine
    starts, when it was trained for a target with another tokenizer or hidden size. Other
    folders are left to vLLM unchanged."""
    import os

    from vllm_spec_plugins.models import _read_json, model_vocab_size, tokenizer_fingerprint
    path = spec.get("model") if isinstance(spec, dict) else None
    marker = os.path.join(path, "drafter.json") if isinstance(path, str) else ""
    if not marker or not os.path.isfile(marker) or not os.path.isdir(str(target_dir)):
        return
    meta = _read_json(marker)
    fp, vocab = tokenizer_fingerprint(target_dir), model_vocab_size(target_dir)
    if meta.get("target_tokenizer") != fp or meta.get("target_vocab_size") != vocab:
        raise ValueError(f"speculative_config.model={path!r} is a drafter for another tokenizer "
                         f"(drafter.json: {meta.get('target_tokenizer', '?')[:12]}, vocab "
                         f"{meta.get('target_vocab_size')}; target {target_dir!r}: {fp[:12]}, vocab "
                         f"{vocab}); retrain it with python -m vllm_spec_plugins.drafters")
    hidden = _read_json(os.path.join(target_dir, "config.json")).get("hidden_size")
    if meta.get("target_hidden_size") not in (None, hidden):
        raise ValueError(f"speculative_config.model={path!r} reads hidden states of size "
                         f"{meta['target_hidden_size']}; the target {target_dir!r} has {hidden}")


def translate(spec: dict, target_model_config=None) -> tuple[dict, dict]:
    """(vLLM speculative_config dict, our parameters)."""
    params = validate(spec)
    vllm_spec = {"method": "custom_class", "model": PROPOSER_PATH,
                 "num_speculative_tokens": params["num_speculative_tokens"]}
    for k in PASSTHROUGH:
        if k in spec:
            vllm_spec[k] = spec[k]
    if target_model_config is not None:
        params["vocab_size"] = target_model_config.get_vocab_size()
        if params["method"] in ("mamba", "cascade") or params.get("drafter") == "mamba" or params.get("check_hidden_states"):
            params["target"] = target_model_config.model   # the drafter (or check) reads the target's head
    return vllm_spec, params
