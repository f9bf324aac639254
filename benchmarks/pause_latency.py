"""How long ``/pause`` takes to acknowledge, against one decode step plus one HTTP round trip.

Two vLLM servers on a ~210 MB bf16 model, one with the plugin scheduler and one with vLLM's
own, so the table shows what the plugin adds. For 1, 8 and 32 streams in flight and for
``pause(keep)`` and ``pause(abort)``, each round measures on each server, back to back:

  step ms    the median decode step while the streams run (token inter-arrival at the client)
  rtt ms     one HTTP round trip to the same server (``GET /v1/models``, median of 5)
  pause ms   ``POST /pause?mode=...`` sent .. returned

Target (plugin scheduler): pause <= step + rtt (median of the per-round ratios,
benchmarks/rounds.py). vLLM's ``AsyncLLM.pause_generation`` ends with a fixed
``asyncio.sleep(0.02)`` (async_llm.py:984 in 0.32, :813 in 0.27.1), which no plugin hook
reaches: every pause on either server pays those 20 ms.

    PYTHONPATH=. python benchmarks/pause_latency.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import sys
import time

from bench_common import MEDIUM_SPEC, rtt_ms, step_ms
from charts import pause_chart
from rounds import MIN_ROUNDS, Target, interleaved, median, report, spread

from tests.support import (
    VLLMServer,
    build_tiny_model,
    engine_args,
    rl_engine_args,
    serving,
)
from tests.support.streams import StreamingCompletion
from vllm_ascend_rl.client import EngineControlClient

SPEC = MEDIUM_SPEC
UPSTREAM_SLEEP_MS = 20.0  # AsyncLLM.pause_generation's asyncio.sleep(0.02)
STREAMS = (1, 8, 32)
MODES = ("keep", "abort")
MAX_TOKENS = 96  # ~30 tokens are out when the pause is sent
WINDOW_S = 0.5  # decode steps are read from this much of steady generation


def one_pause(url: str, n: int, mode: str) -> tuple[float, float, float]:
    """(pause ms, step ms, rtt ms) with ``n`` streams decoding."""
    ctl = EngineControlClient(url, timeout_s=300)
    streams = [
        StreamingCompletion(url, f"Stream {i} says:", MAX_TOKENS, timeout_s=300) for i in range(n)
    ]
    for s in streams:
        s.start()
    for s in streams:
        s.wait_for_tokens(8, timeout_s=120)
    since = time.monotonic()
    time.sleep(WINDOW_S)
    step, rtt = step_ms(streams, since), rtt_ms(url)
    if min(s.num_tokens for s in streams) >= MAX_TOKENS:
        raise RuntimeError("streams finished before the pause: raise MAX_TOKENS")
    t0 = time.perf_counter()
    ctl.pause(mode)
    pause = (time.perf_counter() - t0) * 1e3
    ctl.resume()
    for s in streams:
        s.join(300)
        want = "length" if mode == "keep" else "abort"
        if s.finish_reason != want:
            raise RuntimeError(f"a stream ended {s.finish_reason!r} after pause({mode})")
    return pause, step, rtt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    args = ap.parse_args()
    path = build_tiny_model(SPEC)
    limits = ["--max-num-seqs", "32"]
    servers = {
        "plugin": VLLMServer(path, max_model_len=1024, extra_args=[*rl_engine_args(None), *limits]),
        "upstream": VLLMServer(path, max_model_len=1024, extra_args=[*engine_args(), *limits]),
    }
    with serving(*servers.values()):
        runs = interleaved(
            {
                (name, n, mode): (lambda u=server.url, n=n, mode=mode: one_pause(u, n, mode))
                for n in STREAMS
                for mode in MODES
                for name, server in servers.items()
            },
            args.rounds,
        )
    print(f"\npause acknowledgement, {args.rounds} interleaved rounds (median, spread)\n")
    print(
        "| streams | mode | plugin pause ms | upstream pause ms | plugin / upstream | step ms "
        "| rtt ms | plugin pause / (step + rtt) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    targets = []
    for n in STREAMS:
        for mode in MODES:
            ours, theirs = runs["plugin", n, mode], runs["upstream", n, mode]
            pause, step, rtt = ([r[i] for r in ours] for i in range(3))
            upstream = [r[0] for r in theirs]
            t = Target.of(
                f"pause({mode}) with {n} streams / (step + rtt)",
                pause,
                [s + r for s, r in zip(step, rtt, strict=True)],
                1.0,
            )
            targets.append(t)
            vs = Target.of("", pause, upstream, 1.0)
            print(
                f"| {n} | {mode} | {median(pause):.1f} ±{spread(pause):.1f} | "
                f"{median(upstream):.1f} ±{spread(upstream):.1f} | "
                f"{vs.median:.2f} ±{vs.spread:.2f} | {median(step):.1f} | {median(rtt):.1f} | "
                f"{t.median:.2f} ±{t.spread:.2f} |"
            )
    print(f"\n(every pause includes vLLM's fixed {UPSTREAM_SLEEP_MS:.0f} ms sleep)")
    pause_chart(runs, args.rounds, UPSTREAM_SLEEP_MS)
    return report(targets)


if __name__ == "__main__":
    sys.exit(main())
