"""Our method names and keys -> vLLM's `custom_class` door. Validated before the engine starts.

    {"method": "lookahead", "num_speculative_tokens": 6, "window": 6, "ngram": 4, "guesses": 7}
becomes
    speculative_config = {"method": "custom_class", "model": PROPOSER_PATH, "num_speculative_tokens": 6}
    additional_config["vllm_spec_plugins"] = {"method": "lookahead", "num_speculative_tokens": 6, ...}
"""
from __future__ import annotations

from vllm_spec_plugins.proposers import METHODS, config_class
from vllm_spec_plugins.proposers.base import Key, MethodConfig

ADDITIONAL_KEY = "vllm_spec_plugins"
PROPOSER_PATH = "vllm_spec_plugins.proposer.PluginProposer"
#: methods served only where the tests register them; never offered in messages or docs
TEST_ONLY = ("oracle", "adversarial")
#: `SamplingParams.extra_args` key carrying a digest of the request's `cache_salt` (its tenant)
TENANT_KEY = "vllm_spec_plugins_tenant"


def method_keys(method: str) -> dict[str, Key]:
    """Every key of `method` (default, range, kind, help), from its typed config."""
    return config_class(method).keys()


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
                                 ("--spec-tokens", "num_speculative_tokens",
                                  getattr(engine_args, "spec_tokens", None))):
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
            allowed = sorted(set(_vllm_methods()) | set(METHODS) - set(TEST_ONLY))
            if method not in allowed:
                raise ValueError(f"speculative_config.method={method!r} is unknown; allowed: "
                                 + ", ".join(allowed))
    return spec


def is_plugin_config(spec) -> bool:
    return isinstance(spec, dict) and (spec.get("method") in METHODS)


def validate(spec: dict) -> MethodConfig:
    """The typed config of one of our methods, checked (keys, types, ranges, cross-field rules, the
    drafter folder); ValueError naming the field otherwise."""
    spec = {k.replace("-", "_"): v for k, v in spec.items()}
    method = spec.get("method")
    cls = config_class(method)
    keys = cls.keys()
    unknown = set(spec) - set(keys) - set(PASSTHROUGH) - {"method"}
    if "backoff" in unknown:
        raise ValueError(f"speculative_config.backoff is gone for method {method!r}: goodput (on by default) "
                         "decides per step and per token what pays; remove the key, or set goodput: false "
                         "to always draft num_speculative_tokens")
    if unknown:
        raise ValueError(f"unknown key(s) {sorted(unknown)} in speculative_config for method "
                         f"{method!r}; allowed keys: {', '.join(sorted(set(keys) | set(PASSTHROUGH)))}")
    # an explicit null takes the default (a required key stays missing and is named)
    cfg = cls(**{k: v for k, v in spec.items() if k in keys and v is not None})
    folder = cfg.drafter_folder()
    if folder is not None:
        _check_ssm_drafter(folder, method)
    return cfg


def from_params(params: dict) -> MethodConfig:
    """The typed config back from `translate`'s parameters (in each engine process)."""
    cls = config_class(params["method"])
    return cls(**{k: params[k] for k in cls.keys() if k in params})


def _check_ssm_drafter(path: str, method: str = "mamba") -> None:
    import json
    import os
    if not os.path.isdir(path):
        raise ValueError(f"speculative_config.model={path!r} does not exist or is not a folder "
                         "(make one with: python -m vllm_spec_plugins.tools.drafters --drafter mamba)")
    for f in ("drafter.json", "config.json", "model.safetensors"):
        if not os.access(os.path.join(path, f), os.R_OK):
            raise ValueError(f"speculative_config.model={path!r} has no readable {f}: not a drafter "
                             "made by python -m vllm_spec_plugins.tools.drafters --drafter mamba")
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


SHIPPED_PREFIX = "vllm_spec_plugins:"
#: the file that marks a folder as a drafter exported by `vllm_spec_plugins.tools.drafters`
DRAFTER_MARKER = "drafter.json"


def shipped_drafter(name: str = "smollm2-135m-instruct-eagle"):
    """Path of a drafter shipped in the package (`python -m vllm_spec_plugins.tools.drafters path`)."""
    from pathlib import Path
    p = Path(__file__).parent / "assets" / name
    if not (p / DRAFTER_MARKER).exists():
        raise FileNotFoundError(f"no shipped drafter {name!r} in {p.parent}")
    return p


def resolve_shipped_drafter(spec):
    """`"model": "vllm_spec_plugins:NAME"` -> the folder of drafter NAME shipped in this package
    (for YAML drop-ins, which cannot compute a site-packages path). Returns the (new) spec."""
    model = spec.get("model") if isinstance(spec, dict) else None
    if not (isinstance(model, str) and model.startswith(SHIPPED_PREFIX)):
        return spec
    try:
        path = shipped_drafter(model[len(SHIPPED_PREFIX):])
    except FileNotFoundError as e:
        raise ValueError(f"speculative_config.model={model!r}: {e}") from None
    return {**spec, "model": str(path)}


def check_drafter_marker(spec, target_dir: str) -> None:
    """vLLM's own `eagle` / `draft_model` pointed at a drafter exported by
    `vllm_spec_plugins.tools.drafters` (a folder with drafter.json): refuse it, before the engine
    starts, when it was trained for a target with another tokenizer or hidden size. Other
    folders are left to vLLM unchanged."""
    import os

    from vllm_spec_plugins.tools.models import _read_json, model_vocab_size, tokenizer_fingerprint
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
                         f"{vocab}); retrain it with python -m vllm_spec_plugins.tools.drafters")
    hidden = _read_json(os.path.join(target_dir, "config.json")).get("hidden_size")
    if meta.get("target_hidden_size") not in (None, hidden):
        raise ValueError(f"speculative_config.model={path!r} reads hidden states of size "
                         f"{meta['target_hidden_size']}; the target {target_dir!r} has {hidden}")


def translate(spec: dict, target_model_config=None) -> tuple[dict, dict]:
    """(vLLM speculative_config dict, our parameters: the validated config + what the engine
    process needs to build the proposer)."""
    cfg = validate(spec)
    params = cfg.to_dict()
    vllm_spec = {"method": "custom_class", "model": PROPOSER_PATH,
                 "num_speculative_tokens": cfg.num_speculative_tokens}
    for k in PASSTHROUGH:
        if k in spec:
            vllm_spec[k] = spec[k]
    if target_model_config is not None:
        params["vocab_size"] = target_model_config.get_vocab_size()
        if cfg.needs_target:
            params["target"] = target_model_config.model   # the drafter (or check) reads the target's head
    return vllm_spec, params
