"""The CPU stand-in for Ascend NPUs: a test double, not product. It plugs the device ``cpu``
(gloo, POSIX shared memory, host virtual memory) into ``vllm_ascend_rl``'s hardware seam and
brings the CPU workers the tests and examples start vLLM servers with. ``make test`` and
``make demo`` install it beside the product."""

from pathlib import Path

from setuptools import Extension, setup

PRODUCT_CSRC = str(Path(__file__).resolve().parent.parent / "csrc")  # vmm.h, vmm_table.h

setup(
    name="vllm-ascend-rl-standin",
    version="0.1.0",
    python_requires=">=3.11",
    packages=["npu_standin"],
    ext_modules=[
        Extension(
            "npu_standin.libstandin",
            sources=["csrc/vmm_host.cpp", "csrc/host_copy.cpp"],
            include_dirs=[PRODUCT_CSRC],
            language="c++",
            extra_compile_args=["-std=c++17", "-O2", "-Wall", "-Wextra", "-pthread"],
            extra_link_args=["-pthread"],  # the host back end populates on a few threads
        )
    ],
    entry_points={"vllm_ascend_rl.devices": ["cpu = npu_standin.device:CpuDevice"]},
)
