"""Pause and sync with 1 vs 2 engines behind one trainer (external load balancing).

Two vLLM servers on a ~210 MB bf16 model, HCCL weight transfer, one core each; the trainer is
this script, with one HCCL group per server (see README "Deployment"). In one run:

  pause idle ms   ``EngineControlClient(urls).pause("keep")`` on idle engines (median)
  pause gen ms    the same while every engine streams requests (median of 3 swaps)
  sync s          ``send_weights()`` to each engine, one after the other (median)
  2 / 1           the two-engine figure over the one-engine figure

    PYTHONPATH=. python benchmarks/scale_out.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench_common import MEDIUM_SPEC, model_bytes, trainer_engine

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


def pause_idle_ms(urls: list[str], repeats: int) -> float:
    ctl = EngineControlClient(urls)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        ctl.pause("keep")
        times.append((time.perf_counter() - t0) * 1e3)
        ctl.resume()
    return statistics.median(times)


def pause_generating_ms(urls: list[str], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        out = swap_mid_generation(urls, lambda: None, max_tokens=300)
        assert not out.problems, out.problems
        times.append(out.pause_ms)
    return statistics.median(times)


def sync_s(trainers: list, repeats: int) -> float:
    def once() -> float:
        t0 = time.perf_counter()
        for t in trainers:
            t.send_weights()
        return time.perf_counter() - t0

    once()  # warm-up
    return statistics.median(once() for _ in range(repeats))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
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
        rows = {}
        for n in (1, 2):
            rows[n] = (
                pause_idle_ms(urls[:n], args.repeats),
                pause_generating_ms(urls[:n], 3),
                sync_s(trainers[:n], args.repeats),
            )
        for t in trainers:
            t.shutdown()
    print("\n| engines | pause idle ms | pause generating ms | sync s |")
    print("|---|---|---|---|")
    for n, (idle, gen, sync) in rows.items():
        print(f"| {n} | {idle:.1f} | {gen:.1f} | {sync:.3f} |")
    ratios = [rows[2][i] / rows[1][i] for i in range(3)]
    print(f"| 2 / 1 | {ratios[0]:.2f}x | {ratios[1]:.2f}x | {ratios[2]:.2f}x |")


if __name__ == "__main__":
    main()
