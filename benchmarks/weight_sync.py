"""HCCL weight sync: end to end against its two halves, a raw broadcast, per-tensor sends and
the alternative a user has today (a checkpoint in /dev/shm and vLLM's ``reload_weights``).

One vLLM server per model, this script as the trainer (rank 0) and the worker (rank 1) over
the engine's own channel. Interleaved rounds (benchmarks/rounds.py) on the ~1 GB bf16 model:

  raw        one broadcast of a single buffer holding the model's bytes (the wire's bound)
  e2e        ``send_weights()`` end to end, packed buckets (start -> update -> finish)
  transport  the same update's handshake and buckets, the engine loading nothing
  load       the same buckets, already in the engine's memory, through the same loading
             path (start, layerwise reload of every bucket, finish), nothing received
  /dev/shm   ``save_pretrained`` into /dev/shm, then ``POST /collective_rpc reload_weights``

and on a model of many small tensors, packed against one broadcast per tensor.

Targets: e2e <= 1.15 x max(transport, load) (receiving overlaps loading); /dev/shm reload
>= 2x e2e; raw / e2e >= 0.75; per-tensor >= 3x packed on the many-small model.
On CPU the collective is gloo over loopback.

    PYTHONPATH=. python benchmarks/weight_sync.py [--rounds 5] [--big-layers 10]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time

import psutil
import requests
import torch
from bench_common import (
    bench_server,
    big_spec,
    load_only_s,
    model_bytes,
    paused,
    trainer_engine,
    transport_s,
)
from charts import weight_sync_chart
from rounds import MIN_ROUNDS, Target, interleaved, median, report, spread

import vllm_ascend_rl
from tests.support import TinyModelSpec, build_tiny_model
from tests.support.tiny_model import load_hf_model

HCCL = "ascend_rl_hccl"


def raw_broadcast_s(engine, url: str, buf: torch.Tensor) -> float:
    """Trainer-side seconds for one broadcast of ``buf`` (warm, reused on both sides)."""
    channel = engine.channel
    reply: dict = {}

    def receive() -> None:
        r = requests.post(
            url + "/collective_rpc",
            timeout=600,
            json={"method": "bench_raw_receive", "kwargs": {"nbytes": str(buf.numel())}},
        )
        reply["status"] = r.status_code

    t = threading.Thread(target=receive, daemon=True)
    t.start()
    t0 = time.perf_counter()
    channel.wait(channel.broadcast(buf), "raw broadcast")
    seconds = time.perf_counter() - t0
    t.join(600)
    assert reply.get("status") == 200, reply
    return seconds


def core_seconds(pids: list[int]) -> float:
    """CPU time (user + system) the processes ``pids`` have used so far."""
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def metered(fn, pids: list[int]):
    """``fn`` returning (its result, wall seconds, core-seconds all of ``pids`` used)."""

    def run():
        before, t0 = core_seconds(pids), time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t0, core_seconds(pids) - before

    return run


def shm_reload_s(model: torch.nn.Module, url: str) -> tuple[float, float]:
    """What a user does without a transfer engine: save, then have vLLM reload from the
    path. (save seconds, reload seconds)."""
    where = tempfile.mkdtemp(dir="/dev/shm", prefix="ascend_rl_bench_")
    try:
        t0 = time.perf_counter()
        model.save_pretrained(where, safe_serialization=True)
        saved = time.perf_counter()
        r = requests.post(
            url + "/collective_rpc",
            timeout=600,
            json={"method": "reload_weights", "kwargs": {"weights_path": where}},
        )
        r.raise_for_status()
        return saved - t0, time.perf_counter() - saved
    finally:
        shutil.rmtree(where, ignore_errors=True)


def big_model_rounds(spec: TinyModelSpec, rounds: int) -> tuple[dict, list[Target], float]:
    path = build_tiny_model(spec)
    model = load_hf_model(path)
    nbytes = model_bytes(model)
    print(f"[1GB-bf16] {nbytes / 1e9:.2f} GB; starting vLLM ...", flush=True)
    with bench_server(path, HCCL) as server, paused(server.url):
        engine = trainer_engine(HCCL, server.url, model)
        try:
            engine.send_weights()  # warm both sides' buffers
            transport_s(engine, server.url, keep=True)  # the buckets load_only replays
            buf = torch.ones(nbytes, dtype=torch.uint8)
            pids = [os.getpid(), *server.pids()]  # the trainer and every server process
            variants = {
                "raw": lambda: raw_broadcast_s(engine, server.url, buf),
                "e2e": lambda: engine.send_weights().seconds,
                "transport": lambda: transport_s(engine, server.url),
                "load": lambda: load_only_s(server.url),
                "shm": lambda: shm_reload_s(model, server.url),
            }
            metered_runs = interleaved({k: metered(f, pids) for k, f in variants.items()}, rounds)
        finally:
            engine.shutdown()
    runs = {k: [out for out, _, _ in v] for k, v in metered_runs.items()}
    # How many of the host's cores each variant kept busy: near all of them, and overlapping
    # receiving with loading has no core left to run on.
    busy = {k: [used / wall for _, wall, used in v] for k, v in metered_runs.items()}
    # The least wall time the update could take on this host if receiving and loading
    # overlapped perfectly: their CPU work spread over every core.
    used = {k: [u for _, _, u in v] for k, v in metered_runs.items()}
    floor = [
        (t + ld) / os.cpu_count() for t, ld in zip(used["transport"], used["load"], strict=True)
    ]
    busy["floor"] = [e / f for e, f in zip(runs["e2e"], floor, strict=True)]
    runs["shm_save"] = [s for s, _ in runs["shm"]]
    runs["shm_reload"] = [r for _, r in runs["shm"]]
    runs["shm"] = [s + r for s, r in runs["shm"]]
    bound = [max(t, ld) for t, ld in zip(runs["transport"], runs["load"], strict=True)]
    targets = [
        Target.of("e2e / max(transport, load)", runs["e2e"], bound, 1.15),
        Target.of("/dev/shm reload / e2e", runs["shm"], runs["e2e"], 2.0, at_least=True),
        Target.of("raw / e2e (efficiency)", runs["raw"], runs["e2e"], 0.75, at_least=True),
    ]
    return runs | {f"{k}_busy": v for k, v in busy.items()}, targets, nbytes / 1e9


def small_model_rounds(spec: TinyModelSpec, rounds: int) -> tuple[dict, Target]:
    path = build_tiny_model(spec)
    model = load_hf_model(path)
    print(f"[many-small] {sum(1 for _ in model.parameters())} tensors; starting vLLM ...")
    with bench_server(path, HCCL) as server, paused(server.url):

        def sync(packed: bool) -> float:
            engine = trainer_engine(HCCL, server.url, model, packed=packed)
            try:
                engine.send_weights()  # the pool warms after every init
                return engine.send_weights().seconds
            finally:
                engine.shutdown()

        runs = interleaved({"packed": lambda: sync(True), "tensor": lambda: sync(False)}, rounds)
    return runs, Target.of(
        "per-tensor / packed", runs["tensor"], runs["packed"], 3.0, at_least=True
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    ap.add_argument("--big-layers", type=int, default=10, help="layers of the ~1 GB model")
    args = ap.parse_args()
    vllm_ascend_rl.register()
    runs, targets, gb = big_model_rounds(big_spec(args.big_layers), args.rounds)
    small = TinyModelSpec(
        seed=1, num_layers=48, hidden_size=128, num_heads=2, num_kv_heads=2, intermediate_size=256
    )
    small_runs, small_target = small_model_rounds(small, args.rounds)

    print(f"\nHCCL sync of {gb:.2f} GB bf16, {args.rounds} interleaved rounds (median ±spread, s)")
    print()
    print("| | raw broadcast | e2e | transport only | load only | /dev/shm save + reload |")
    print("|---|---|---|---|---|---|")

    def cell(key: str) -> str:
        return f"{median(runs[key]):.3f} ±{spread(runs[key]):.3f}"

    print(
        f"| seconds | {cell('raw')} | {cell('e2e')} | {cell('transport')} | {cell('load')} | "
        f"{cell('shm')} ({median(runs['shm_save']):.2f} + {median(runs['shm_reload']):.2f}) |"
    )
    busy = " | ".join(
        f"{median(runs[k + '_busy']):.2f}" for k in ("raw", "e2e", "transport", "load", "shm")
    )
    print(f"| cores busy (of {os.cpu_count()}) | {busy} |")
    print(
        f"\ne2e / the host's floor ((transport + load core-seconds) / {os.cpu_count()} cores): "
        f"{median(runs['floor_busy']):.2f} ±{spread(runs['floor_busy']):.2f}"
    )
    p, t = small_runs["packed"], small_runs["tensor"]
    print(
        f"\nmany small tensors: packed {median(p):.3f} ±{spread(p):.3f} s, per-tensor "
        f"{median(t):.3f} ±{spread(t):.3f} s"
    )
    weight_sync_chart(runs, small_runs, gb, args.rounds)
    return report([*targets, small_target])


if __name__ == "__main__":
    sys.exit(main())
