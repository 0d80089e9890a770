import os

# Before anything imports vLLM: in-process engines, one thread, a small KV cache.
for k, v in {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
             "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
             "TOKENIZERS_PARALLELISM": "false",
             # the test-only methods `oracle` and `adversarial`, in this process and every vLLM
             # process it starts (the plugin's register() reads it)
             "VLLM_SPEC_PLUGINS_TEST_METHODS": "1"}.items():
    os.environ.setdefault(k, v)

import pytest  # noqa: E402


def pytest_configure(config):
    from vllm_spec_plugins.proposers import testing
    testing.register()
    config.addinivalue_line("markers", "slow: long end-to-end suites (run with -m slow)")
    config.addinivalue_line("markers", "extended: slow tests that run a path the default or CI suites already "
                            "run, for another method, batch size or mode (in -m slow; CI leaves them out)")
    config.addinivalue_line("markers", "network: needs PyPI (downloads the newest vLLM source)")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """An extended test is a slow one too, before `-m` selects: `-m slow` runs it, `-m "not slow"`
    leaves it out."""
    for item in items:
        if item.get_closest_marker("extended") and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def default_model():
    from vllm_spec_plugins.tools.models import build_default_model
    return str(build_default_model())


@pytest.fixture(scope="session")
def tiny_model():
    from vllm_spec_plugins.tools.models import build_tiny_model, cache_root
    return str(build_tiny_model(cache_root() / "tiny-test-llama", seed=0, force=False))


@pytest.fixture(scope="session")
def heldout_prompts():
    from vllm_spec_plugins.tools.data import make_prompts
    return make_prompts(categories=("chat", "code"), n_per_category=4, split="heldout")


@pytest.fixture(scope="session")
def tiny_mamba_drafter(tiny_model, tmp_path_factory):
    """An untrained Mamba drafter for the tiny model (lossless whatever it drafts)."""
    from vllm_spec_plugins.tools.drafters import random_ssm_drafter
    return str(random_ssm_drafter(tiny_model, tmp_path_factory.mktemp("drafter") / "mamba", seed=0,
                                  head_dim=16, d_state=16))
