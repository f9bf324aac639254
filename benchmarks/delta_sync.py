"""Delta (sparse) weight sync vs a dense sync of the same model, HCCL transport.

One vLLM server on the ~1 GB bf16 model, this script as the trainer. Each round, interleaved
(benchmarks/rounds.py), measures ``send_weights()`` end to end:

  dense    a ``delta=False`` connection sends every byte
  delta    a ``delta=True`` connection (after its first, whole sync) sends what changed since,
           after one of these updates of the trainer's weights:
             adam  one Adam step at an RL learning rate (1e-6) on bf16 weights
             1%, 10%, 50%  that share of every tensor's elements moved

Targets: at <= 10% changed, delta <= 0.3x dense; never slower than dense by more than 5%.

    PYTHONPATH=. python benchmarks/delta_sync.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import sys

import torch
from bench_common import bench_server, big_spec, model_bytes, paused, trainer_engine
from rounds import MIN_ROUNDS, Target, interleaved, median, report, spread

import vllm_ascend_rl
from tests.support import build_tiny_model
from tests.support.tiny_model import load_hf_model

LEVELS = ("adam", 0.01, 0.10, 0.50)
RL_LR = 1e-6


@torch.no_grad()
def update(model: torch.nn.Module, level, seed: int) -> float:
    """Change the trainer's weights as ``level`` says; the share of elements that changed."""
    gen = torch.Generator().manual_seed(seed)
    changed = total = 0
    for p in model.parameters():
        before = p.detach().clone()
        if level == "adam":  # first Adam step: m / sqrt(v) = sign(g)
            g = torch.randn(p.shape, generator=gen)
            p.copy_((p.float() - RL_LR * g.sign()).to(p.dtype))
        else:
            moved = torch.rand(p.shape, generator=gen) < level
            p.add_(torch.where(moved, p.abs().clamp_min(1e-2) / 2, 0))
        changed += int((p.view(torch.int16) != before.view(torch.int16)).sum())
        total += p.numel()
    return changed / total


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    ap.add_argument("--layers", type=int, default=10, help="layers of the ~1 GB model")
    args = ap.parse_args()
    vllm_ascend_rl.register()
    path = build_tiny_model(big_spec(args.layers))
    model = load_hf_model(path)
    nbytes = model_bytes(model)
    print(f"{nbytes / 1e9:.2f} GB bf16; starting vLLM ...", flush=True)
    shares: dict = {level: [] for level in LEVELS}
    sent: dict = {level: [] for level in LEVELS}
    seed = iter(range(1_000_000))
    with bench_server(path, "ascend_rl_hccl") as server, paused(server.url):

        def dense() -> float:
            engine = trainer_engine("ascend_rl_hccl", server.url, model)
            try:
                return engine.send_weights().seconds
            finally:
                engine.shutdown()

        def delta() -> dict:
            engine = trainer_engine("ascend_rl_hccl", server.url, model, delta=True)
            try:
                engine.send_weights()  # whole: the base
                out = {}
                for level in LEVELS:
                    shares[level].append(update(model, level, next(seed)))
                    result = engine.send_weights()
                    sent[level].append(result.bytes / nbytes)
                    out[level] = result.seconds
                return out
            finally:
                engine.shutdown()

        runs = interleaved({"dense": dense, "delta": delta}, args.rounds)
    dense_s = runs["dense"]
    print(f"\ndelta vs dense sync, {args.rounds} interleaved rounds (median, spread)\n")
    print("| update | elements changed | bytes sent / dense | delta s | dense s | delta / dense |")
    print("|---|---|---|---|---|---|")
    targets = []
    for level in LEVELS:
        delta_s = [r[level] for r in runs["delta"]]
        label = level if isinstance(level, str) else f"{level:.0%}"
        small = level == "adam" or level <= 0.10
        t = Target.of(f"delta/dense at {label}", delta_s, dense_s, 0.3 if small else 1.05)
        targets.append(t)
        print(
            f"| {label} | {100 * median(shares[level]):.2f}% | "
            f"{median(sent[level]):.3f} | {median(delta_s):.3f} ±{spread(delta_s):.3f} | "
            f"{median(dense_s):.3f} ±{spread(dense_s):.3f} | {t.median:.2f} ±{t.spread:.2f} |"
        )
    return report(targets)


if __name__ == "__main__":
    sys.exit(main())
