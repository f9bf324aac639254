"""The device the examples' and the e2e suites' servers and trainers run on: one switch
(``VLLM_ASCEND_RL_DEVICE=npu``, which ``pytest --device npu`` and the examples' ``--device npu``
set) makes the same code start NPU servers and trainers instead of CPU ones.

Chips on NPU (vllm-ascend's memory profiling is device-wide, so two servers starting on one
chip disturb each other's KV-cache sizing):

- every server takes chips of its own from this process's :class:`ChipPool`, the lowest free
  ones, when it starts, and gives them back when it stops. Only on a host with too few chips
  do servers share one; a later one then starts once the earlier ones are up, one stops only
  once those starting are up, and their memory fractions together fit the chip;
- a colocated (NPU-IPC) trainer rank sits on its engine worker's chip;
- an HCCL trainer rank takes a chip of its own: the highest chip its engine does not use
  (HCCL needs one rank per device).

How many chips, and how much memory each has, is the Ascend CI runner's
(``.github/ascend-runner.json``, which the workflow runs on): on NPU the pool holds that many
chips when ``VLLM_ASCEND_RL_CHIPS`` says so (the workflow does), else every visible one; on CPU
it hands out that many emulated chips (``npu_standin.chip``) of that memory,
device-wide through a ledger of this process, and a CPU worker sizes its start-up from it as
vllm-ascend does. So a layout that does not fit the runner fails on CPU first: a server
refused at start-up for want of free memory, or the pool's own check that the servers on a chip
ask for at most all of it (:class:`ChipPool`). Every server asks :data:`MEMORY_FRACTION` of each
of its chips; the pool records the most any chip held (``peak``), which the suite reports.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from vllm_ascend_rl.device import device_kind
from vllm_ascend_rl.device.npu import RL_ADDITIONAL_CONFIG

RUNNER_FILE = Path(__file__).resolve().parents[2] / ".github" / "ascend-runner.json"
# --gpu-memory-utilization of every test server: a chip of the two-chip runner holds three
# shared servers, a module's and, on CPU, the next module's started early (0.75), leaving a
# quarter of it (16 GiB of 64) to trainer processes; 0.15 x 64 GiB gives a tiny model's KV
# cache gigabytes (tests/unit/test_chip_layout.py counts the suite as it is).
MEMORY_FRACTION = "0.15"
CPU_CHIP_WORKER = "npu_standin.worker.ChipCPUWorker"
CPU_SLEEPABLE_WORKER = "npu_standin.worker.SleepableCPUWorker"
NPU_SLEEPABLE_WORKER = "vllm_ascend_rl.worker.npu_worker.SleepableNPUWorker"


@dataclass(frozen=True)
class DeviceProfile:
    kind: str
    sleepable_worker: str
    memory_fraction: str  # --gpu-memory-utilization
    server_env: dict[str, str] = field(default_factory=dict)
    additional_config: dict = field(default_factory=dict)
    default_worker: str | None = None  # --worker-cls of a server that names none
    # --worker-extension-cls of a server that names no worker class or extension: the
    # plugin's workers have the address ledger, vLLM's get it from this extension.
    default_extension: str | None = None
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
        if self.kind != "npu":  # the CPU stand-in's emulated chips (installed by make)
            from npu_standin.chip import CHIP_BYTES_ENV, LEDGER_ENV, VISIBLE_ENV

            return {
                VISIBLE_ENV: ",".join(map(str, chips)),
                LEDGER_ENV: chip_pool().ledger,
                CHIP_BYTES_ENV: str(ascend_runner()["chip_memory_gib"] << 30),
            }
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
        return chip_pool().take(server, count, float(self.memory_fraction))

    def give_back_chips(self, server: Any) -> None:
        chip_pool().give_back(server)

    def chip_sharers(self, server: Any) -> list[Any]:
        """The other servers on one of ``server``'s chips (only on a host with too few)."""
        return chip_pool().sharers(server)


class ChipPool:
    """The host's chips (NPU or emulated), handed out to the servers this process starts:
    each takes the lowest chips nobody holds; when too few are free, the least shared ones.
    A server asks ``fraction`` of each of its chips' memory; the servers on one chip may ask
    for all of it at most (vllm-ascend refuses a start with less free than asked,
    ``worker.py:424-436``)."""

    def __init__(self, count: int, ledger: str = "") -> None:
        self.count = count
        self.ledger = ledger  # CPU: the emulated chips' memory ledger of this session
        self._held: dict[int, dict[Any, float]] = {chip: {} for chip in range(count)}
        self.peak: dict[int, tuple[int, float]] = {}  # chip -> most (servers, memory) held
        self._lock = threading.Lock()

    def take(self, owner: Any, count: int, fraction: float = 0.0) -> list[int]:
        if count > self.count:
            raise RuntimeError(f"a server needs {count} chips; this host has {self.count}")
        with self._lock:
            by_load = sorted(self._held, key=lambda chip: (len(self._held[chip]), chip))
            chips = sorted(by_load[:count])
            for chip in chips:
                asked = sum(self._held[chip].values()) + fraction
                if asked > 1.0 + 1e-9:
                    raise RuntimeError(
                        f"chip {chip} of {self.count} would hold {len(self._held[chip]) + 1} "
                        f"servers asking {asked:.2f} of its memory: the suite's layout does "
                        "not fit this host (docs/deployment.md, 'Ascend CI')"
                    )
            for chip in chips:
                self._held[chip][owner] = fraction
                held = (len(self._held[chip]), sum(self._held[chip].values()))
                self.peak[chip] = max(self.peak.get(chip, (0, 0.0)), held)
            return chips

    def give_back(self, owner: Any) -> None:
        with self._lock:
            for holders in self._held.values():
                holders.pop(owner, None)

    def sharers(self, owner: Any) -> list[Any]:
        with self._lock:
            found: list[Any] = []
            for holders in self._held.values():
                if owner in holders:
                    found += [h for h in holders if h is not owner and h not in found]
            return found


_POOL: ChipPool | None = None
_POOL_LOCK = threading.Lock()


@cache
def ascend_runner() -> dict[str, Any]:
    """The Ascend CI runner: ``chips``, ``chip_memory_gib`` (its label: the ASCEND_RUNNER
    repository variable)."""
    return json.loads(RUNNER_FILE.read_text())


def chip_pool() -> ChipPool:
    """This process's pool of the host's chips: on NPU ``VLLM_ASCEND_RL_CHIPS`` of those
    ``ASCEND_RT_VISIBLE_DEVICES`` names (else every ``/dev/davinci<N>``), or all of them; on
    CPU the runner's chips, emulated."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            if device_kind() == "npu":
                _POOL = ChipPool(_npu_chip_count())
            else:
                ledger = tempfile.mkdtemp(prefix="vllm_ascend_rl_chip_ledger-")
                atexit.register(shutil.rmtree, ledger, ignore_errors=True)
                _POOL = ChipPool(ascend_runner()["chips"], ledger)
        return _POOL


def layout_report() -> str | None:
    """The most any chip held at once in this process, if it started servers."""
    if _POOL is None or not _POOL.peak:
        return None
    held = ", ".join(
        f"chip {chip}: {n} servers asking {asked:.2f} of its memory"
        for chip, (n, asked) in sorted(_POOL.peak.items())
    )
    return f"chip layout on {_POOL.count} {device_kind()} chips, at most: {held}"


def _npu_chip_count() -> int:
    visible = _host_chip_count()
    wanted = int(os.environ.get("VLLM_ASCEND_RL_CHIPS") or visible)
    if wanted > visible:
        raise RuntimeError(f"VLLM_ASCEND_RL_CHIPS={wanted}, but this host shows {visible} NPUs")
    return wanted


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
            default_extension="vllm_ascend_rl.worker.ledger.AddressLedger",
            memory_fraction=MEMORY_FRACTION,
            # The README's engine: torch_npu's expandable segments off (the sleep pools need
            # it) and vllm-ascend's FRACTAL_NZ off (it refuses weight updates and wake_up with
            # NZ on), by flags vllm-ascend's frontend hands the engine core unchanged.
            server_env={"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:False"},
            additional_config=dict(RL_ADDITIONAL_CONFIG),
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
