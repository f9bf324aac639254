"""What the e2e suites need to know about the device they run on: one switch
(``VLLM_ASCEND_RL_DEVICE=npu``, which ``pytest --device npu`` sets) makes the same tests start
NPU servers and trainers instead of CPU ones.

On NPU the engine runs on chips ``0..n-1`` of ``ASCEND_RT_VISIBLE_DEVICES``; a colocated
(NPU-IPC) trainer rank shares its engine worker's chip, an HCCL trainer takes the next free
chip (HCCL needs one rank per device).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from vllm_ascend_rl.device import device_kind

CPU_SLEEPABLE_WORKER = "vllm_ascend_rl.worker.cpu_worker.SleepableCPUWorker"
NPU_SLEEPABLE_WORKER = "vllm_ascend_rl.worker.npu_worker.SleepableNPUWorker"


@dataclass(frozen=True)
class DeviceProfile:
    kind: str
    sleepable_worker: str
    memory_fraction: str  # --gpu-memory-utilization
    server_env: dict[str, str] = field(default_factory=dict)
    additional_config: dict = field(default_factory=dict)

    def chip_name(self, chip: int) -> str:
        """How NPU IPC names the ``chip``-th chip the tests use (``location()["chip"]``)."""
        if self.kind != "npu":
            return f"cpu{chip}"
        visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
        return visible.split(",")[chip].strip() if visible else str(chip)

    def chips_env(self, chips: list[int]) -> dict[str, str]:
        """Environment that puts a process on ``chips`` (of the host's visible ones)."""
        if self.kind != "npu":
            return {}
        return {"ASCEND_RT_VISIBLE_DEVICES": ",".join(self.chip_name(c) for c in chips)}


def current_profile() -> DeviceProfile:
    if device_kind() == "npu":
        return DeviceProfile(
            kind="npu",
            sleepable_worker=NPU_SLEEPABLE_WORKER,
            memory_fraction="0.5",
            # The sleep pools need torch_npu's expandable segments off; rl_config turns
            # vllm-ascend's FRACTAL_NZ off (it refuses weight updates and wake_up with NZ on).
            server_env={"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:False"},
            additional_config={"rl_config": {"enabled": True}},
        )
    return DeviceProfile(kind="cpu", sleepable_worker=CPU_SLEEPABLE_WORKER, memory_fraction="0.1")


def trainer_env(engine_chips: int, colocated: bool, rank: int = 0) -> dict[str, str]:
    """A trainer rank's environment: on the engine's chip ``rank`` when colocated (NPU IPC),
    on the first chip after the engine's otherwise (HCCL)."""
    profile = current_profile()
    return profile.chips_env([rank if colocated else engine_chips + rank])
