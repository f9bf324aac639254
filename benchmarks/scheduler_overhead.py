"""Per-step cost of ``schedule()`` + ``update_from_output()``: our schedulers vs upstream's.

A synthetic trace of 512 requests (prompt 16-512 tokens, 16-256 output tokens, seeded) runs to
completion through each scheduler class, built from vLLM's own config and request objects
with a fake model runner (no model). Every class sees the same trace; the classes run
interleaved, several rounds, and the median per-step time is reported.

    python benchmarks/scheduler_overhead.py [--rounds 5]

Target: ours <= 1.03x upstream.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time

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
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    model_path = build_tiny_model(TinyModelSpec())
    requests = trace(args.requests)
    per_step: dict[str, list[float]] = {label: [] for label, *_ in CASES}
    steps: dict[str, int] = {}
    for _ in range(args.rounds + 1):  # round 0 warms up
        for label, cls, config, _up in CASES:
            seconds, steps[label] = run(cls, config, requests, model_path)
            per_step[label].append(seconds)
    median = {label: statistics.median(v[1:]) for label, v in per_step.items()}
    print(f"\n{args.requests} requests, median of {args.rounds} rounds\n")
    print("| scheduler | steps | us per step | vs upstream |")
    print("|---|---|---|---|")
    verdicts = []
    for label, _cls, _config, upstream in CASES:
        ratio = median[label] / median[upstream] if upstream else 1.0
        print(f"| {label} | {steps[label]} | {1e6 * median[label]:.0f} | {ratio:.3f}x |")
        if upstream:
            verdicts.append((label, ratio))
    print()
    for label, ratio in verdicts:
        verdict = "met" if ratio <= 1.03 else "NOT met"
        print(f"target {label} <= 1.03x upstream: {ratio:.3f}x ({verdict})")
    return 0 if all(r <= 1.03 for _, r in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
