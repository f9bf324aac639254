"""Speculative decoding through RL updates: acceptance and decode speed of a fresh engine,
after a target-only update, and after target + drafter, side by side in one run.

One engine (HCCL, vLLM's CPU worker on an emulated chip) serves the tiny target with its
one-layer drafter (``tests/support/spec_decode.py``: it predicts the fresh target exactly), method
``draft_model``, 3 tokens a step. A trainer holds both on v2. Each round puts both models back
on v1 ("fresh": the same weights a fresh engine holds), sends the target ("target-only"), then
the drafter ("target + drafter"), and after each state times greedy completions of four
prompts, 96 tokens each, one after another:

  acceptance     accepted / drafted tokens (vLLM's spec-decode counters on /metrics)
  tokens/s       generated tokens over the completions' wall time

No target: the figures show what a drafter left behind costs an RL loop on this pair. The
first round's "fresh" is the engine as started, before any update.

    PYTHONPATH=. python benchmarks/draft_updates.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from rounds import MIN_ROUNDS, median, spread

from tests.support import free_port
from tests.support.spec_decode import acceptance, draft_server, models
from tests.support.trainer import TrainerProcess

STATES = ("fresh", "target-only", "target + drafter")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    args = ap.parse_args()
    (target_v1, drafter_v1), (target_v2, drafter_v2) = models()
    logs = Path(tempfile.mkdtemp(prefix="draft_updates_"))
    server = draft_server("ascend_rl_hccl", logs / "engine.log", sleepable=False)
    figures: dict[str, list[tuple[float, float]]] = {state: [] for state in STATES}
    with server, TrainerProcess(target_v2, log_path=logs / "trainer.log") as trainer:
        acceptance(server.url, 8)  # warm
        info = {"world_size": 2, "master_address": "127.0.0.1", "timeout_s": 60}
        trainer.init("ascend_rl_hccl", server.url, master_port=free_port(), **info)
        for round_ in range(args.rounds):
            if round_:
                trainer.load(target_v1)
                trainer.load_draft(drafter_v1)
                trainer.send(weight_version="v1")
                trainer.send(weight_version="v1", draft=True)
            figures["fresh"].append(acceptance(server.url, 96))
            trainer.load(target_v2)
            trainer.load_draft(drafter_v2)
            trainer.send(weight_version="v2")
            figures["target-only"].append(acceptance(server.url, 96))
            trainer.send(weight_version="v2", draft=True)
            figures["target + drafter"].append(acceptance(server.url, 96))
    print(f"\nspeculative decoding after RL updates, {args.rounds} rounds (median, spread)\n")
    print("| state | acceptance | tokens/s |")
    print("|---|---|---|")
    for state, rows in figures.items():
        rates, speeds = [r for r, _ in rows], [s for _, s in rows]
        print(
            f"| {state} | {median(rates):.3f} ± {spread(rates):.3f} | "
            f"{median(speeds):.1f} ± {spread(speeds):.1f} |"
        )
    print(f"\nlogs: {logs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
