"""Sleep/wake of a KV cache in CaMem virtual memory vs the naive free-and-reallocate.

For KV caches of 1 and 4 GiB (one buffer, as vLLM allocates it, placed by the allocator's
``kv_cache`` pool exactly as ``SleepableCPUWorker`` does), the variants run interleaved, one
sleep/wake cycle per variant per round (benchmarks/rounds.py):

  CaMem level 1  ``CaMemAllocator.sleep`` backs ``weights`` up (a 256 MiB weights allocation
                 rides along) and releases everything; wake maps the KV cache, then restores
                 the weights
  CaMem level 2  the same without a backup
  naive          ``del`` the tensor (+ ``malloc_trim``), then ``torch.zeros`` it again: a new
                 address, so every view, pointer and captured graph is stale

  sleep s        the sleep (naive: the free)
  wake s         **wake plus first touch**: the KV cache is mapped back at its address and one
                 byte per page is written (every block used right after waking), so memory the
                 back end maps lazily is paid for here and not hidden in the first forward
                 pass (naive: ``torch.zeros``, which touches every page itself)
  weights wake s level 1's staged ``wake_up(["weights"])``: the 256 MiB backup restored
  freed          drop of this process's RSS across the sleep, as a share of the KV bytes

Targets: freed >= 95% of the KV bytes; KV wake (with first touch) <= naive re-zeroing.

    python benchmarks/sleep_wake.py [--sizes-gib 1 4] [--rounds 5]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from functools import partial

import psutil
import torch
from charts import sleep_wake_chart
from rounds import MIN_ROUNDS, Target, interleaved, median, report, spread

from vllm_ascend_rl.device import get_device
from vllm_ascend_rl.sleep.allocator import CaMemAllocator

GiB = 1 << 30
WEIGHTS_BYTES = 256 << 20
PAGE = 4096


def rss() -> int:
    return psutil.Process().memory_info().rss


def touch(t: torch.Tensor) -> None:
    t[::PAGE] = 1  # one write per page


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class CaMemCycle:
    """A KV cache and a weights allocation; ``cycle(level)`` is one sleep/wake cycle. Both
    levels use the one instance: a process has one allocation table, and every allocator
    instance of a back end sleeps every entry in it (a second pair would lose the first's
    weights)."""

    def __init__(self, kv_bytes: int) -> None:
        self.alloc = CaMemAllocator("host")
        self.kv_bytes = kv_bytes
        with self.alloc.use_memory_pool("weights"):
            self.weights = torch.empty(WEIGHTS_BYTES, dtype=torch.uint8)
        self.weights.fill_(7)
        with self.alloc.use_memory_pool("kv_cache"):
            self.kv = torch.zeros(kv_bytes, dtype=torch.uint8)
        self.addr = self.kv.data_ptr()

    def cycle(self, level: int) -> dict:
        before = rss()
        offload = ("weights",) if level == 1 else ()
        sleep = timed(lambda: self.alloc.sleep(offload_tags=offload))
        freed = before - rss()
        wake = timed(lambda: (self.alloc.wake_up(["kv_cache"]), touch(self.kv)))
        weights = timed(lambda: self.alloc.wake_up(["weights"]))
        assert self.kv.data_ptr() == self.addr, "the KV cache moved"
        assert level != 1 or int(self.weights[::PAGE].min()) == 7, "level 1 lost weights"
        self.weights.fill_(7)  # level 2 woke zeros: the reload a real engine does (untimed)
        return {"sleep": sleep, "wake": wake, "weights": weights, "freed": freed}

    def close(self) -> None:
        del self.kv, self.weights
        for a in list(self.alloc.allocations):
            self.alloc.free(a)


class NaiveCycle:
    def __init__(self, kv_bytes: int) -> None:
        self.kv_bytes = kv_bytes
        self.kv: torch.Tensor | None = torch.zeros(kv_bytes, dtype=torch.uint8)
        touch(self.kv)

    def __call__(self) -> dict:
        before = rss()

        def release() -> None:
            self.kv = None
            gc.collect()
            get_device("cpu").empty_cache()

        sleep = timed(release)
        freed = before - rss()

        def realloc() -> None:
            self.kv = torch.zeros(self.kv_bytes, dtype=torch.uint8)

        return {"sleep": sleep, "wake": timed(realloc), "weights": 0.0, "freed": freed}

    def close(self) -> None:
        self.kv = None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-gib", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    args = ap.parse_args()
    print(f"sleep/wake, {args.rounds} interleaved rounds per size (median, spread)\n")
    print(
        "| KV GiB | method | sleep s | KV wake s (with first touch) | ms/GiB | weights wake s "
        "| freed GiB | freed / KV | same address |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    targets, by_size = [], {}
    for gib in args.sizes_gib:
        kv_bytes = gib * GiB
        camem, naive_cycle = CaMemCycle(kv_bytes), NaiveCycle(kv_bytes)
        cycles = {
            "CaMem level 1": partial(camem.cycle, 1),
            "CaMem level 2": partial(camem.cycle, 2),
            "naive free + zeros": naive_cycle,
        }
        try:
            runs = interleaved(cycles, args.rounds)
        finally:
            camem.close()
            naive_cycle.close()
        by_size[gib] = runs
        naive = [r["wake"] for r in runs["naive free + zeros"]]
        for name, rows in runs.items():
            col = {k: [r[k] for r in rows] for k in rows[0]}
            share = median(col["freed"]) / kv_bytes
            print(
                f"| {gib} | {name} | {median(col['sleep']):.3f} | {median(col['wake']):.3f} "
                f"±{spread(col['wake']):.3f} | {1e3 * median(col['wake']) / gib:.0f} | "
                f"{median(col['weights']):.3f} | {median(col['freed']) / GiB:.2f} | "
                f"{share:.1%} | {'yes' if name.startswith('CaMem') else 'not guaranteed'} |"
            )
            if name.startswith("CaMem"):
                targets.append(
                    Target(f"{gib} GiB {name} freed / KV", [f / kv_bytes for f in col["freed"]],
                           0.95, at_least=True)
                )  # fmt: skip
                targets.append(
                    Target.of(f"{gib} GiB {name} KV wake / naive", col["wake"], naive, 1.0)
                )
    sleep_wake_chart(by_size, args.rounds)
    return report(targets)


if __name__ == "__main__":
    sys.exit(main())
