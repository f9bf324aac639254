"""Wake plus first token, eager against vLLM's default compile mode (ACL graphs on Ascend): the
figure users compare with vllm#45648 (wake 3-4.5x slower with CUDA graphs there).

Two servers on the 0.21 GB model with the sleepable worker and 1 GiB of KV cache, one
``--enforce-eager``, one in compile mode, run interleaved (benchmarks/rounds.py), one cycle per
server and level per round. A cycle sleeps (untimed), then times:

  wake s         level 1: ``/wake_up``; level 2: ``/wake_up?tags=weights``, ``reload_weights``
                 from disk, ``/wake_up?tags=kv_cache``
  first token s  a 1-token greedy completion right after the wake
  moved          tensors the address ledger saw move across all cycles (``moved_addresses``)

Target: wake + first token in compile mode <= 1.5 x eager's, per level (the address guarantee
means no re-capture after a wake).

    PYTHONPATH=. python benchmarks/wake_graphs.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import ExitStack

from bench_common import MEDIUM_SPEC
from rounds import MIN_ROUNDS, Target, interleaved, median, report, spread

from tests.support import build_tiny_model, complete
from tests.support.sleep_servers import sleepable_server
from vllm_ascend_rl.client import EngineControlClient

PROMPT = "Wake and answer:"


def cycle(url: str, model: str, level: int) -> dict[str, float]:
    ctl = EngineControlClient(url, timeout_s=300)
    ctl.sleep(level)
    t0 = time.perf_counter()
    if level == 1:
        ctl.wake_up()
    else:
        ctl.wake_up(["weights"])
        ctl.reload_weights(model)
        ctl.wake_up(["kv_cache"])
    t1 = time.perf_counter()
    complete(url, PROMPT, 1)
    return {"wake": t1 - t0, "first": time.perf_counter() - t1}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    args = ap.parse_args()
    model = str(build_tiny_model(MEDIUM_SPEC))
    with ExitStack() as stack:
        urls = {}
        for mode in ("eager", "compile"):
            server = sleepable_server(model, f"/tmp/wake_graphs_{mode}.log", graphs=mode != "eager")
            urls[mode] = stack.enter_context(server).url
        for url in urls.values():
            complete(url, PROMPT, 1)  # compiled and warm before the first round
        variants = {
            (mode, level): (lambda u=url, lv=level: cycle(u, model, lv))
            for mode, url in urls.items()
            for level in (1, 2)
        }
        runs = interleaved(variants, args.rounds)
        moved = {
            m: EngineControlClient(u).collective_rpc("moved_addresses") for m, u in urls.items()
        }
    print(f"\nwake + first token, {args.rounds} interleaved rounds (median, spread)\n")
    print("| level | mode | wake s | first token s | wake + first token s | moved |")
    print("|---|---|---|---|---|---|")
    totals = {k: [r["wake"] + r["first"] for r in rows] for k, rows in runs.items()}
    for (mode, level), rows in sorted(runs.items(), key=lambda kv: (kv[0][1], kv[0][0] != "eager")):
        count = sum(len(w) for workers in moved[mode] or [] for w in workers)
        print(
            f"| {level} | {mode} | {median([r['wake'] for r in rows]):.3f} | "
            f"{median([r['first'] for r in rows]):.3f} | {median(totals[mode, level]):.3f} "
            f"±{spread(totals[mode, level]):.3f} | {count} |"
        )
    targets = [
        Target.of(f"level {lv} compile / eager", totals["compile", lv], totals["eager", lv], 1.5)
        for lv in (1, 2)
    ]
    return report(targets)


if __name__ == "__main__":
    sys.exit(main())
