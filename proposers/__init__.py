"""Engine-agnostic proposers (no vLLM import), and the registry of served methods.

A method is one module here holding a `MethodConfig` subclass (its keys: defaults, ranges, help;
its cross-field rules; `build(env)` -> the proposer) and one line in `METHODS`.
"""
from __future__ import annotations

import importlib

#: speculative_config "method" -> "module:ConfigClass"
METHODS: dict[str, str] = {
    "lookahead": "vllm_spec_plugins.proposers.lookahead:LookaheadConfig",
    "mamba": "vllm_spec_plugins.proposers.mamba:MambaConfig",
    "cascade": "vllm_spec_plugins.proposers.cascade:CascadeConfig",
    "bandit_tree": "vllm_spec_plugins.proposers.bandit:BanditTreeConfig",
}


def register_method(name: str, target: str) -> None:
    """Serve one more method: `target` = "module:ConfigClass" (e.g. the tests' `oracle`)."""
    METHODS[name] = target


def config_class(name: str):
    """The `MethodConfig` subclass of method `name` (KeyError if it is not registered)."""
    module, _, cls = METHODS[name].partition(":")
    return getattr(importlib.import_module(module), cls)
