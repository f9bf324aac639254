"""Per-step cost of ``schedule()`` + ``update_from_output()``: our schedulers vs upstream's.

A synthetic trace of 512 requests (prompt 16-512 tokens, 16-256 output tokens, seeded) runs to
completion through each scheduler class, built from vLLM's own config and request objects
with a fake model runner (no model). Every class sees the same trace; the classes run
interleaved (benchmarks/rounds.py): the median per-step time and the median of the per-round
ratios are reported with their spread, and a target fails only beyond the spread.

    python benchmarks/scheduler_overhead.py [--rounds 5]

Target: ours <= 1.03x upstream.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time

from rounds import MIN_ROUNDS, Target, interleaved, median, report, spread
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from tests.support import TinyModelSpec, build_tiny_model
from tests.support.scheduler import SchedulerHarness, fake_model_output
from vllm_ascend_rl.core.recompute_scheduler import AsyncRecomputeScheduler, RecomputeScheduler

BOUNCE = {"ascend_rl": {"recompute_mode": "bounce"}}
CASES = [  # (label, class, additional_config, upstream label)
    ("Scheduler (upstream)", Scheduler, {}, None),
    ("RecomputeScheduler local", RecomputeScheduler, {}, "Scheduler (upstream)"),
    ("RecomputeScheduler bounce", RecomputeScheduler, BOUNCE, "Scheduler (upstream)"),
    ("AsyncScheduler (upstream)", AsyncScheduler, {}, None),
    ("AsyncRecomputeScheduler local", AsyncRecomputeScheduler, {}, "AsyncScheduler (upstream)"),
    (
        "AsyncRecomputeScheduler bounce",
        AsyncRecomputeScheduler,
        BOUNCE,
        "AsyncScheduler (upstream)",
    ),
]


def trace(n: int, seed: int = 0) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(16, 512), rng.randint(16, 256)) for _ in range(n)]


def run(cls, config: dict, requests: list[tuple[int, int]], model_path) -> tuple[float, int]:
    """Seconds per step (schedule + update) over the whole trace, and the step count."""
    h = SchedulerHarness(
        cls,
        model_path=model_path,
        num_blocks=4096,  # plenty: the comparison is of the common path, no preemptions
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        additional_config=config,
    )
    sched = h.scheduler
    for i, (prompt, out) in enumerate(requests):
        sched.add_request(h.make_request(prompt, out, first_token=i))
    gc.collect()
    gc.disable()  # collector pauses land on whichever class runs; keep them out
    try:
        return _drive(sched)
    finally:
        gc.enable()


def _drive(sched) -> tuple[float, int]:
    steps, spent = 0, 0.0
    while sched.has_requests():
        t0 = time.perf_counter()
        out = sched.schedule()
        spent += time.perf_counter() - t0
        model_out = fake_model_output(sched, out)  # the model's part, not timed
        t0 = time.perf_counter()
        sched.update_from_output(out, model_out)
        spent += time.perf_counter() - t0
        steps += 1
    return spent / steps, steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    args = ap.parse_args()
    model_path = build_tiny_model(TinyModelSpec())
    requests = trace(args.requests)
    steps: dict[str, int] = {}

    def variant(label: str, cls, config: dict):
        def measure() -> float:
            seconds, steps[label] = run(cls, config, requests, model_path)
            return seconds

        return measure

    per_step = interleaved(
        {label: variant(label, cls, config) for label, cls, config, _ in CASES}, args.rounds
    )
    print(f"\n{args.requests} requests, {args.rounds} interleaved rounds (median, spread)\n")
    print("| scheduler | steps | us per step | spread | vs upstream (per-round median) |")
    print("|---|---|---|---|---|")
    targets = []
    for label, _cls, _config, upstream in CASES:
        us = [1e6 * s for s in per_step[label]]
        ratio = "1"
        if upstream:
            t = Target.of(f"{label} vs upstream", per_step[label], per_step[upstream], 1.03)
            targets.append(t)
            ratio = f"{t.median:.3f}x ±{t.spread:.3f}"
        print(f"| {label} | {steps[label]} | {median(us):.0f} | ±{spread(us):.0f} | {ratio} |")
    return report(targets)


if __name__ == "__main__":
    sys.exit(main())
