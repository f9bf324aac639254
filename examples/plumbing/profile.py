"""The device the examples' and the e2e suites' servers and trainers run on: one switch
(``VLLM_ASCEND_RL_DEVICE=npu``, which ``pytest --device npu`` and the examples' ``--device npu``
set) makes the same code start NPU servers and trainers instead of CPU ones.

Chips on NPU (vllm-ascend's memory profiling is device-wide, so two servers starting on one
chip disturb each other's KV-cache sizing):

- every server takes chips of its own from this process's :class:`ChipPool`, the lowest free
  ones, when it starts, and gives them back when it stops. Only on a host with too few chips
  do two servers share one; the later one then starts once the earlier one is up, and the
  memory fraction (0.4) leaves room for both;
- a colocated (NPU-IPC) trainer rank sits on its engine worker's chip;
- an HCCL trainer rank takes a chip of its own: the highest chip its engine does not use
  (HCCL needs one rank per device).

On CPU the same pool hands out :data:`CPU_HOST_CHIPS` emulated chips
(``vllm_ascend_rl.device.cpu_chip``): their memory is device-wide through a ledger of this
process, and a CPU worker sizes its start-up from it as vllm-ascend does, so a layout that starts
two servers on one chip together fails on CPU too.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm_ascend_rl.device import device_kind
from vllm_ascend_rl.device.cpu_chip import LEDGER_ENV, VISIBLE_ENV

CPU_HOST_CHIPS = 8  # the emulated host: an Atlas 800 A2's eight chips
MEMORY_FRACTION = "0.4"  # --gpu-memory-utilization: two servers fit on a chip they must share
CPU_CHIP_WORKER = "vllm_ascend_rl.worker.cpu_worker.ChipCPUWorker"
CPU_SLEEPABLE_WORKER = "vllm_ascend_rl.worker.cpu_worker.SleepableCPUWorker"
NPU_SLEEPABLE_WORKER = "vllm_ascend_rl.worker.npu_worker.SleepableNPUWorker"


@dataclass(frozen=True)
class DeviceProfile:
    kind: str
    sleepable_worker: str
    memory_fraction: str  # --gpu-memory-utilization
    server_env: dict[str, str] = field(default_factory=dict)
    additional_config: dict = field(default_factory=dict)
    default_worker: str | None = None  # --worker-cls of a server that names none
    # Added to the niceness of a server's engine processes (its API server's descendants).
    engine_niceness: int = 0

    def chip_name(self, chip: int) -> str:
        """How NPU IPC names the ``chip``-th chip the tests use (``location()["chip"]``)."""
        if self.kind != "npu":
            return f"cpu{chip}"
        visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
        return visible.split(",")[chip].strip() if visible else str(chip)

    def chips_env(self, chips: Sequence[int]) -> dict[str, str]:
        """Environment that puts a process on ``chips`` (of the host's visible ones)."""
        if self.kind != "npu":
            return {VISIBLE_ENV: ",".join(map(str, chips)), LEDGER_ENV: chip_pool().ledger}
        return {"ASCEND_RT_VISIBLE_DEVICES": ",".join(self.chip_name(c) for c in chips)}

    def server_chips_env(self, chips: Sequence[int]) -> dict[str, str]:
        """A server's environment on ``chips``. On CPU the OpenMP threads of each worker in a
        process of its own (tensor or data parallel) are also bound to a core of its chip's
        (vLLM's automatic binding puts every worker on core 0, so two would share one)."""
        env = self.chips_env(chips)
        if self.kind != "npu":
            cores = sorted(os.sched_getaffinity(0))
            env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(cores[c % len(cores)]) for c in chips)
        return env

    def take_chips(self, server: Any, count: int) -> list[int]:
        """The chips ``server`` runs on until :meth:`give_back_chips`: its own from the pool."""
        return chip_pool().take(server, count)

    def give_back_chips(self, server: Any) -> None:
        chip_pool().give_back(server)

    def chip_sharers(self, server: Any) -> list[Any]:
        """The other servers on one of ``server``'s chips (only on a host with too few)."""
        return chip_pool().sharers(server)


class ChipPool:
    """The host's chips (NPU or emulated), handed out to the servers this process starts:
    each takes the lowest chips nobody holds; when too few are free, the least shared ones."""

    def __init__(self, count: int, ledger: str = "") -> None:
        self.count = count
        self.ledger = ledger  # CPU: the emulated chips' memory ledger of this session
        self._held: dict[int, list[Any]] = {chip: [] for chip in range(count)}
        self._lock = threading.Lock()

    def take(self, owner: Any, count: int) -> list[int]:
        if count > self.count:
            raise RuntimeError(f"a server needs {count} chips; this host has {self.count}")
        with self._lock:
            by_load = sorted(self._held, key=lambda chip: (len(self._held[chip]), chip))
            chips = sorted(by_load[:count])
            for chip in chips:
                self._held[chip].append(owner)
            return chips

    def give_back(self, owner: Any) -> None:
        with self._lock:
            for holders in self._held.values():
                if owner in holders:
                    holders.remove(owner)

    def sharers(self, owner: Any) -> list[Any]:
        with self._lock:
            found: list[Any] = []
            for holders in self._held.values():
                if owner in holders:
                    found += [h for h in holders if h is not owner and h not in found]
            return found


_POOL: ChipPool | None = None
_POOL_LOCK = threading.Lock()


def chip_pool() -> ChipPool:
    """This process's pool of the host's chips: on NPU those ``ASCEND_RT_VISIBLE_DEVICES``
    names, else every ``/dev/davinci<N>``; on CPU :data:`CPU_HOST_CHIPS` emulated ones."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            if device_kind() == "npu":
                _POOL = ChipPool(_host_chip_count())
            else:
                ledger = tempfile.mkdtemp(prefix="vllm_ascend_rl_chip_ledger-")
                atexit.register(shutil.rmtree, ledger, ignore_errors=True)
                _POOL = ChipPool(CPU_HOST_CHIPS, ledger)
        return _POOL


def _host_chip_count() -> int:
    visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
    if visible:
        return len(visible.split(","))
    try:
        count = sum(bool(re.fullmatch(r"davinci\d+", n)) for n in os.listdir("/dev"))
    except OSError:
        count = 0
    if not count:
        raise RuntimeError(
            "cannot tell how many NPUs this host has (no /dev/davinci<N>): set "
            "ASCEND_RT_VISIBLE_DEVICES to the chips the tests may use"
        )
    return count


def current_profile() -> DeviceProfile:
    if device_kind() == "npu":
        return DeviceProfile(
            kind="npu",
            sleepable_worker=NPU_SLEEPABLE_WORKER,
            memory_fraction=MEMORY_FRACTION,
            # The sleep pools need torch_npu's expandable segments off; rl_config turns
            # vllm-ascend's FRACTAL_NZ off (it refuses weight updates and wake_up with NZ on).
            server_env={"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:False"},
            additional_config={"rl_config": {"enabled": True}},
        )
    # On CPU the KV cache is VLLM_CPU_KVCACHE_SPACE; the fraction sizes a worker's share of
    # its emulated chip, and every worker runs on one (stand-in d), as on NPU.
    return DeviceProfile(
        kind="cpu",
        sleepable_worker=CPU_SLEEPABLE_WORKER,
        memory_fraction=MEMORY_FRACTION,
        default_worker=CPU_CHIP_WORKER,
        # vLLM's CPU platform gives a one-worker engine's worker a process of its own
        # (platforms/cpu.py, unless VLLM_ENABLE_V1_MULTIPROCESSING is 0). On NPU it runs in
        # the engine core (vLLM's "uni" default, config/parallel.py; vllm-ascend keeps it),
        # as it then does here, and each server start imports vLLM once fewer: about 8 s of
        # CPU. One OpenMP thread, as the bound worker process had: vLLM cannot bind a process
        # whose OpenMP pool exists, and two threads round with the batch's shape (a greedy
        # run then parts from a reference at a near-tie, hundreds of tokens in).
        server_env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"},
        # A CPU engine core decodes the tiny models in a busy loop; on a small host its API
        # server would then fall seconds behind it (tokens, and the answers to /pause and
        # /resume), so the engine runs on after a pause is sent. The API server comes first.
        engine_niceness=10,
    )


def engine_chip_list(engine_chips: Sequence[int] | int) -> list[int]:
    """The engine's chips, or the lowest ``engine_chips`` when given a count."""
    return list(range(engine_chips)) if isinstance(engine_chips, int) else list(engine_chips)


def trainer_chip(engine_chips: Sequence[int] | int, colocated: bool, rank: int = 0) -> int:
    """The chip of trainer rank ``rank``: its engine worker's chip when colocated (NPU IPC);
    otherwise (HCCL) one of its own, the ``rank``-th highest the engine does not use.

    ``engine_chips``: the engine's chips (``VLLMServer.chips``; several engines behind a load
    balancer: all of theirs), or how many it has when it holds the lowest ones."""
    chips = engine_chip_list(engine_chips)
    if colocated:
        return chips[rank]
    own = [c for c in reversed(range(chip_pool().count)) if c not in chips]
    if rank >= len(own):
        raise RuntimeError(
            f"HCCL trainer rank {rank} needs a chip of its own; the engine uses {chips} of "
            f"this host's {chip_pool().count}"
        )
    return own[rank]
