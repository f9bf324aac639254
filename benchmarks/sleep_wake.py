"""Sleep/wake of a KV cache in CaMem virtual memory vs the naive free-and-reallocate.

For KV caches of 1 and 4 GiB (one buffer, as vLLM allocates it, placed by the allocator's
``kv_cache`` pool exactly as ``SleepableCPUWorker`` does), in one run and per sleep level:

  sleep s        ``CaMemAllocator.sleep``: level 1 backs ``weights`` up (a 256 MiB weights
                 allocation rides along to show that path) and releases everything; level 2
                 releases everything without a backup
  KV wake s      ``wake_up(["kv_cache"])``: maps physical memory back at the same address
                 (zero-filled; the kernel supplies the pages on first touch)
  KV wake+touch  KV wake plus writing one byte per page of the KV cache (the worst case: every
                 block used right after waking)
  weights wake   ``wake_up(["weights"])`` (staged wake): level 1 restores the 256 MiB backup
  freed          drop of this process's RSS across the sleep, as a share of the KV bytes
                 (level 1 also releases the weights' mapped copy, whose host backup is
                 resident from the first cycle on, as on NPU; level 2 wakes the weights
                 untouched, so from the second cycle on only the KV cache is resident)
  naive          ``del`` the tensor (+ ``malloc_trim``), then ``torch.zeros`` it again: a new
                 address, so every view, pointer and captured graph is stale

Targets: freed >= 95% of the KV bytes; level-1 wake <= 50 ms per GiB.

    python benchmarks/sleep_wake.py [--sizes-gib 1 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import psutil
import torch

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


def camem_row(alloc: CaMemAllocator, kv_bytes: int, level: int, repeats: int) -> dict:
    with alloc.use_memory_pool("weights"):
        weights = torch.empty(WEIGHTS_BYTES, dtype=torch.uint8)
    weights.fill_(7)
    with alloc.use_memory_pool("kv_cache"):
        kv = torch.zeros(kv_bytes, dtype=torch.uint8)
    addr = kv.data_ptr()
    offload = ("weights",) if level == 1 else ()
    sleeps, wakes, touches, weight_wakes, freed = [], [], [], [], []
    for _ in range(repeats):
        before = rss()
        sleeps.append(timed(lambda: alloc.sleep(offload_tags=offload)))
        freed.append(before - rss())
        wakes.append(timed(lambda: alloc.wake_up(["kv_cache"])))
        touches.append(wakes[-1] + timed(lambda: touch(kv)))
        weight_wakes.append(timed(lambda: alloc.wake_up(["weights"])))
    assert kv.data_ptr() == addr, "the KV cache moved"
    assert level != 1 or int(weights[::PAGE].min()) == 7, "level 1 lost the weights"
    for a in list(alloc.allocations):
        alloc.free(a)
    return {
        "sleep": statistics.median(sleeps),
        "wake": statistics.median(wakes),
        "touch": statistics.median(touches),
        "weights": statistics.median(weight_wakes),
        "freed": statistics.median(freed),
    }


def naive_row(kv_bytes: int, repeats: int) -> dict:
    kv = torch.zeros(kv_bytes, dtype=torch.uint8)
    touch(kv)
    frees, reallocs, freed = [], [], []
    for _ in range(repeats):
        before = rss()

        def release():
            nonlocal kv
            del kv
            gc.collect()
            get_device("cpu").empty_cache()

        frees.append(timed(release))
        freed.append(before - rss())

        def realloc():
            nonlocal kv
            kv = torch.zeros(kv_bytes, dtype=torch.uint8)

        reallocs.append(timed(realloc))
    return {
        "sleep": statistics.median(frees),
        "wake": statistics.median(reallocs),
        "touch": statistics.median(reallocs),
        "freed": statistics.median(freed),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-gib", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    alloc = CaMemAllocator("host")
    print(
        "| KV GiB | method | sleep s | KV wake s | KV wake ms/GiB | KV wake+touch s "
        "| weights wake s | freed GiB | freed / KV | same address |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    verdicts = []
    for gib in args.sizes_gib:
        kv_bytes = gib * GiB
        for level in (1, 2):
            r = camem_row(alloc, kv_bytes, level, args.repeats)
            share = r["freed"] / kv_bytes
            per_gib = 1e3 * r["wake"] / gib
            print(
                f"| {gib} | CaMem level {level} | {r['sleep']:.3f} | {r['wake']:.4f} | "
                f"{per_gib:.1f} | {r['touch']:.3f} | {r['weights']:.3f} | "
                f"{r['freed'] / GiB:.2f} | {share:.1%} | yes |"
            )
            verdicts.append((f"{gib} GiB L{level} freed >= 95% of KV", share >= 0.95, share))
            if level == 1:
                verdicts.append((f"{gib} GiB L1 wake <= 50 ms/GiB", per_gib <= 50, per_gib))
        n = naive_row(kv_bytes, args.repeats)
        print(
            f"| {gib} | naive free + zeros | {n['sleep']:.3f} | {n['wake']:.4f} | "
            f"{1e3 * n['wake'] / gib:.1f} | {n['touch']:.3f} | - | {n['freed'] / GiB:.2f} | "
            f"{n['freed'] / kv_bytes:.1%} | not guaranteed |"
        )
    print()
    for name, ok, value in verdicts:
        print(f"target {name}: {value:.3g} ({'met' if ok else 'NOT met'})")
    return 0 if all(ok for _, ok, _ in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
