"""Emulated chips of the CPU stand-in, strict where our code depends on how NPU chips behave.

- One chip per process (:func:`current_chip`): an engine worker claims its own
  (:func:`claim_chip`), and touching another chip's memory is then an error.
- ``VLLM_ASCEND_RL_CPU_CHIPS`` ("4,5") maps logical to host chips (``ASCEND_RT_VISIBLE_DEVICES``).
- Device-wide memory (:data:`CHIP_BYTES`, or ``VLLM_ASCEND_RL_CPU_CHIP_BYTES``), shared by
  every process on a chip through a ledger directory (``VLLM_ASCEND_RL_CPU_CHIP_LEDGER``; a
  dead process's file counts for nothing), as an NPU's ``mem_get_info`` counts every process
  and vllm-ascend sizes the KV cache from it (``vllm_ascend/worker/worker.py:424-436`` refuses
  a start with less free than ``gpu_memory_utilization`` x total; ``:512-547`` gives the KV
  cache only what others left).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

CHIP_BYTES = 64 << 30  # an Atlas A2 (910B) chip's HBM, unless CHIP_BYTES_ENV says otherwise
VISIBLE_ENV = "VLLM_ASCEND_RL_CPU_CHIPS"
LEDGER_ENV = "VLLM_ASCEND_RL_CPU_CHIP_LEDGER"
CHIP_BYTES_ENV = "VLLM_ASCEND_RL_CPU_CHIP_BYTES"

_CLAIMED: list[int] = []  # the logical chip this process's engine worker owns, once known


def claim_chip(index: int) -> None:
    """From now on this process is the engine worker of logical chip ``index`` only."""
    if _CLAIMED and _CLAIMED[0] != index:
        raise RuntimeError(f"this process already serves emulated chip {_CLAIMED[0]}")
    _CLAIMED[:] = [index]


def current_chip() -> int:
    """This process's logical chip: the one it claimed (an engine worker's, by the CPU worker
    classes), else its ``torch.distributed`` rank (in a vLLM worker its global rank; a trainer
    rank ``r``, which joins its ranks' default group before its weight-transfer init, sits on
    chip ``r``), else 0."""
    if _CLAIMED:
        return _CLAIMED[0]
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0


def check_own_chip(index: int) -> None:
    if _CLAIMED and _CLAIMED[0] != index:
        raise RuntimeError(
            f"the engine worker of emulated chip {_CLAIMED[0]} touched chip {index}: "
            "on an NPU that would open a context on another worker's chip and miss its own"
        )


def host_chip(index: int) -> int:
    """The host chip behind logical chip ``index`` of this process."""
    visible = os.environ.get(VISIBLE_ENV)
    if not visible:
        return index
    chips = [int(c) for c in visible.split(",")]
    if not 0 <= index < len(chips):
        raise RuntimeError(f"emulated chip {index} is not visible ({VISIBLE_ENV}={visible})")
    return chips[index]


class ChipMemory:
    """Device-wide memory of host chip ``chip``, shared by every process on this host."""

    def __init__(self, chip: int) -> None:
        self.chip = chip
        root = os.environ.get(LEDGER_ENV) or Path(
            tempfile.gettempdir(), "vllm_ascend_rl_chip_ledger"
        )
        self.dir = Path(root, f"chip{chip}")

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes, counting every live process's use, as on an NPU."""
        used = 0
        for entry in self.dir.glob("*"):  # nothing if the directory does not exist yet
            if entry.name.isdigit() and _alive(int(entry.name)):
                try:
                    used += int(entry.read_text() or 0)
                except (OSError, ValueError):
                    pass  # being replaced: os.replace makes the next read whole
        total = int(os.environ.get(CHIP_BYTES_ENV) or CHIP_BYTES)
        return max(0, total - used), total

    def record(self, nbytes: int, pid: int | None = None) -> None:
        """This process (or ``pid``) now uses ``nbytes`` of the chip."""
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / str(pid or os.getpid())
        tmp = path.with_suffix(".tmp")
        tmp.write_text(str(int(nbytes)))
        os.replace(tmp, path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    return True


@dataclass(frozen=True)
class StartupMemory:
    """A worker's view of its chip at start-up, as vllm-ascend's ``init_snapshot``."""

    chip: ChipMemory
    free: int
    requested: int  # gpu_memory_utilization x total

    @classmethod
    def take(cls, chip: ChipMemory, utilization: float) -> StartupMemory:
        """Refuse a start with less free memory than requested (vllm-ascend
        ``worker.py:426-436``: two servers on one chip must fit together)."""
        free, total = chip.mem_get_info()
        requested = int(total * utilization)
        if free < requested:
            raise ValueError(
                f"Free memory on emulated chip {chip.chip} ({free / 2**30:.2f}/"
                f"{total / 2**30:.2f} GiB) on startup is less than desired GPU memory "
                f"utilization ({utilization}, {requested / 2**30:.2f} GiB). Decrease GPU "
                "memory utilization or reduce GPU memory used by other processes."
            )
        return cls(chip, free, requested)

    def kv_budget(self, own_bytes: int) -> int:
        """What the KV cache gets after the profile: the request less this worker's own use
        (``own_bytes``) and less whatever other processes took meanwhile, which vllm-ascend
        cannot tell from its own (``worker.py:512-547``)."""
        free_now, _ = self.chip.mem_get_info()
        if free_now + own_bytes > self.free:
            raise AssertionError(
                f"Error in memory profiling on emulated chip {self.chip.chip}: free memory "
                "grew while profiling (another process on the chip released memory)"
            )
        others = self.free - free_now - own_bytes
        budget = self.requested - own_bytes - others
        if budget <= 0:
            raise ValueError(
                f"No available memory for the cache blocks on emulated chip {self.chip.chip}:"
                f" {others / 2**30:.2f} GiB were taken by other processes on the chip while "
                "this worker profiled its memory (start servers that share a chip one after "
                "the other)"
            )
        return budget
