"""Pause and sync with 1 vs 2 engines behind one trainer (external load balancing).

Two vLLM servers on a ~210 MB bf16 model, HCCL weight transfer, one core each; the trainer is
this script, with one HCCL group per server (see docs/deployment.md). In one run:

  pause idle ms   ``EngineControlClient(urls).pause("keep")`` on idle engines
  pause gen ms    the same while every engine streams requests
  sync s          ``send_weights()`` to each engine, one after the other
  2 / 1           the two-engine figure over the one-engine figure, per round

1 and 2 engines are measured in interleaved rounds (benchmarks/rounds.py); no targets.

    PYTHONPATH=. python benchmarks/scale_out.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import time

from bench_common import MEDIUM_SPEC, model_bytes, paused, trainer_engine
from rounds import MIN_ROUNDS, interleaved, median, spread

import vllm_ascend_rl
from tests.support import (
    VLLMServer,
    build_tiny_model,
    load_hf_model,
    rl_engine_args,
    serving,
)
from tests.support.rl_step import swap_mid_generation
from vllm_ascend_rl.client import EngineControlClient

SPEC = MEDIUM_SPEC


def pause_idle_ms(urls: list[str]) -> float:
    ctl = EngineControlClient(urls)
    t0 = time.perf_counter()
    ctl.pause("keep")
    ms = (time.perf_counter() - t0) * 1e3
    ctl.resume()
    return ms


def pause_generating_ms(urls: list[str]) -> float:
    out = swap_mid_generation(urls, lambda: None, max_tokens=300)
    assert not out.problems, out.problems
    return out.pause_ms


def sync_s(trainers: list, urls: list[str]) -> float:
    with paused(*urls):
        t0 = time.perf_counter()
        for t in trainers:
            t.send_weights()
        return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    args = ap.parse_args()
    vllm_ascend_rl.register()
    path = build_tiny_model(SPEC)
    model = load_hf_model(path)
    print(f"model: {model_bytes(model) / 1e9:.2f} GB bf16; starting 2 servers ...")
    servers = [
        VLLMServer(
            path,
            max_model_len=1024,
            env={"VLLM_CPU_OMP_THREADS_BIND": core},
            extra_args=rl_engine_args("ascend_rl_hccl"),
        )
        for core in ("0", "1")
    ]
    with serving(*servers):
        urls = [s.url for s in servers]
        trainers = [trainer_engine("ascend_rl_hccl", u, model) for u in urls]
        with paused(*urls):
            for t in trainers:
                t.send_weights()  # warm both sides' buffers

        def step(n: int):
            def run() -> tuple[float, float, float]:
                return (
                    pause_idle_ms(urls[:n]),
                    pause_generating_ms(urls[:n]),
                    sync_s(trainers[:n], urls[:n]),
                )

            return run

        runs = interleaved({1: step(1), 2: step(2)}, args.rounds)
        for t in trainers:
            t.shutdown()
    columns = ("pause idle ms", "pause generating ms", "sync s")
    print(f"\n1 vs 2 engines, {args.rounds} interleaved rounds (median ±spread)\n")
    print("| engines | " + " | ".join(columns) + " |")
    print("|---|---|---|---|")
    formats = (".1f", ".1f", ".3f")
    for n in (1, 2):
        cells = [[r[i] for r in runs[n]] for i in range(3)]
        print(
            f"| {n} | "
            + " | ".join(
                f"{median(c):{f}} ±{spread(c):{f}}" for c, f in zip(cells, formats, strict=True)
            )
            + " |"
        )
    ratios = []
    for i in range(3):
        per_round = [b[i] / a[i] for a, b in zip(runs[1], runs[2], strict=True)]
        ratios.append(f"{median(per_round):.2f}x ±{spread(per_round):.2f}")
    print("| 2 / 1 | " + " | ".join(ratios) + " |")


if __name__ == "__main__":
    main()
