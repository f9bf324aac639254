"""A stand-in for vllm-ascend's plugin registration, installable on ``sys.path``.

It is a distribution (``*.dist-info`` with a ``vllm.general_plugins`` entry point) whose
function registers exactly vllm-ascend's weight-transfer names the way vllm-ascend@182b75e does
(``vllm_ascend/distributed/weight_transfer/__init__.py``): engines ``hccl`` and ``npu_ipc``,
trainer ``npu_ipc``, plus trainer ``hccl`` (its open refactor), all without a guard. Every
process that runs it appends its PID to ``$STANDIN_MARKER`` if that is set.

Its entry point has a name of its own: vLLM keeps general plugins by entry-point name, so one
named like vllm-ascend's (``ascend_kv_connector``) would shadow the real one, or be shadowed by
it. Where vllm-ascend is installed it is the test, and the stand-in must not be installed: both
would register the same names, and vLLM refuses a second registration
(:func:`real_vllm_ascend_installed`).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DIST = "vllm_ascend_standin"
ENTRY_POINT = "vllm_ascend_standin"

# name -> (factory, class name in the stand-in's module)
THEIR_NAMES = {
    ("WeightTransferEngineFactory", "hccl"): "HCCLWeightTransferEngine",
    ("WeightTransferEngineFactory", "npu_ipc"): "NPUIPCWeightTransferEngine",
    ("WeightTransferTrainerFactory", "npu_ipc"): "NPUIPCTrainerWeightTransferEngine",
    ("WeightTransferTrainerFactory", "hccl"): "HCCLTrainerWeightTransferEngine",
}

_PACKAGE = """
import os

from vllm.distributed.weight_transfer.factory import (
    WeightTransferEngineFactory,
    WeightTransferTrainerFactory,
)

{classes}


def register_connector():
    marker = os.environ.get("STANDIN_MARKER")
    if marker:
        with open(marker, "a") as f:
            f.write(f"{{os.getpid()}}\\n")
{calls}
"""


def real_vllm_ascend_installed() -> bool:
    """Whether vllm-ascend itself is importable here (an Ascend host)."""
    return importlib.util.find_spec("vllm_ascend") is not None


def install_standin(root: Path) -> Path:
    """Write the stand-in distribution under ``root``; return the directory to put on
    ``sys.path``/``PYTHONPATH``."""
    root.mkdir(parents=True, exist_ok=True)
    classes = "\n".join(f"class {c}:\n    pass\n" for c in sorted(set(THEIR_NAMES.values())))
    calls = "\n".join(
        f'    {factory}.register_engine("{name}", "{DIST}", "{cls}")'
        for (factory, name), cls in THEIR_NAMES.items()
    )
    (root / DIST).mkdir(exist_ok=True)
    (root / DIST / "__init__.py").write_text(_PACKAGE.format(classes=classes, calls=calls))
    info = root / f"{DIST}-0.0.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DIST}\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text(
        f"[vllm.general_plugins]\n{ENTRY_POINT} = {DIST}:register_connector\n"
    )
    return root
