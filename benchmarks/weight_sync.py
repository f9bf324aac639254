"""HCCL weight-sync throughput: packed and per-tensor ``send_weights`` vs one raw broadcast.

In one run, between the same two processes (this script as the trainer, rank 0, and the vLLM
worker, rank 1, over the engine's own channel):

  (a) raw    one broadcast of a single buffer holding the model's total bytes (the bound)
  (b) packed ``send_weights()`` end to end, packed buckets (start -> update -> finish)
  (c) tensor ``send_weights()`` end to end, one broadcast per tensor

for a >= 1 GB bf16 model and for a model with many small tensors. efficiency = (a) / (b) in
seconds. Targets: packed efficiency >= 0.75; packed >= 3x faster than per-tensor on the
many-small-tensor model. On CPU the collective is gloo over loopback.

    python benchmarks/weight_sync.py [--repeats 3] [--big-layers 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

import requests
import torch
from bench_common import (
    bench_server,
    big_spec,
    e2e_s,
    median_transport_s,
    model_bytes,
    trainer_engine,
)

import vllm_ascend_rl
from tests.support import TinyModelSpec, build_tiny_model
from tests.support.tiny_model import load_hf_model


def raw_broadcast_s(engine, url: str, buf: torch.Tensor) -> float:
    """Trainer-side seconds for one broadcast of ``buf`` (warm, reused on both sides)."""
    channel = engine.channel
    nbytes = buf.numel()
    reply: dict = {}

    def receive() -> None:
        r = requests.post(
            url + "/collective_rpc",
            timeout=600,
            json={"method": "bench_raw_receive", "kwargs": {"nbytes": str(nbytes)}},
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


def measure(name: str, spec: TinyModelSpec, repeats: int) -> dict:
    path = build_tiny_model(spec)
    model = load_hf_model(path)
    nbytes = model_bytes(model)
    ntensors = sum(1 for _ in model.parameters())
    print(f"[{name}] {nbytes / 1e9:.2f} GB in {ntensors} tensors; starting vLLM ...", flush=True)
    row = {"model": name, "GB": nbytes / 1e9, "tensors": ntensors}
    with bench_server(path, "ascend_rl_hccl") as server:
        for mode, packed in (("packed", True), ("tensor", False)):
            engine = trainer_engine("ascend_rl_hccl", server.url, model, packed=packed)
            row[f"{mode}_s"] = e2e_s(engine, repeats)
            row[f"{mode}_transport_s"] = median_transport_s(engine, server.url, repeats)
            if packed:
                buf = torch.ones(nbytes, dtype=torch.uint8)
                raw_broadcast_s(engine, server.url, buf)  # warm-up
                row["raw_s"] = statistics.median(
                    raw_broadcast_s(engine, server.url, buf) for _ in range(repeats)
                )
                del buf
            engine.shutdown()
    row["efficiency"] = row["raw_s"] / row["packed_s"]
    row["speedup"] = row["tensor_s"] / row["packed_s"]
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--big-layers", type=int, default=10, help="layers of the >= 1 GB model")
    args = ap.parse_args()
    vllm_ascend_rl.register()
    big = big_spec(args.big_layers)
    small = TinyModelSpec(
        seed=1, num_layers=48, hidden_size=128, num_heads=2, num_kv_heads=2, intermediate_size=256
    )
    rows = [measure("1GB-bf16", big, args.repeats), measure("many-small", small, args.repeats)]

    print(
        "\n| model | GB | tensors | (a) raw bcast s | (b) packed e2e s | (c) per-tensor e2e s "
        "| efficiency (a)/(b) | packed speedup (c)/(b) | packed transport s | per-tensor "
        "transport s | transport efficiency |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['GB']:.2f} | {r['tensors']} | {r['raw_s']:.3f} | "
            f"{r['packed_s']:.3f} | {r['tensor_s']:.3f} | {r['efficiency']:.2f} | "
            f"{r['speedup']:.2f}x | {r['packed_transport_s']:.3f} | "
            f"{r['tensor_transport_s']:.3f} | {r['raw_s'] / r['packed_transport_s']:.2f} |"
        )
    print(
        "transport = the same buckets on the same channel, receiver not loading (vLLM's "
        "layerwise reload excluded)"
    )
    eff, speed = rows[0]["efficiency"], rows[1]["speedup"]
    print(
        f"\ntarget packed efficiency >= 0.75 on {rows[0]['model']}: {eff:.2f} "
        f"({'met' if eff >= 0.75 else 'NOT met'})"
    )
    print(
        f"target packed >= 3x per-tensor on {rows[1]['model']}: {speed:.2f}x "
        f"({'met' if speed >= 3 else 'NOT met'})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
