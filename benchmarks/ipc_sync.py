"""NPU-IPC weight sync vs its memcpy bound and vs the HCCL engine, on a >= 1 GB bf16 model.

In one run (this script is the trainer, colocated with the vLLM worker):

  memcpy      one copy of the model's total bytes between two warm buffers (the bound: the
              staging copy alone)
  transport   ``send_weights`` data plane: handles, staging copies, the engine's copy-out,
              doorbells; the engine does not load (no layerwise reload)
  IPC e2e     ``send_weights`` end to end (start -> update -> finish, layerwise reload)
  HCCL e2e    the HCCL engine's ``send_weights`` end to end on the same model

Targets: transport <= 2x memcpy; IPC end to end faster than HCCL. On CPU, NPU IPC is POSIX
shared memory and HCCL is gloo over loopback.

    python benchmarks/ipc_sync.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

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
from tests.support import build_tiny_model
from tests.support.tiny_model import load_hf_model
from vllm_ascend_rl.device import current_device


def memcpy_s(nbytes: int, repeats: int) -> float:
    device = current_device()
    src = torch.ones(nbytes, dtype=torch.uint8, device=device.torch_device())
    dst = torch.zeros_like(src)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        device.copy_bytes(dst, src)
        device.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    vllm_ascend_rl.register()
    path = build_tiny_model(big_spec())
    model = load_hf_model(path)
    nbytes = model_bytes(model)
    print(f"model: {nbytes / 1e9:.2f} GB bf16", flush=True)
    row = {}
    with bench_server(path, "ascend_rl_npu_ipc") as server:
        # The bound is measured beside the idle engine, as the transport is.
        row["memcpy_s"] = memcpy_s(nbytes, args.repeats)
        engine = trainer_engine("ascend_rl_npu_ipc", server.url, model)
        row["ipc_s"] = e2e_s(engine, args.repeats)
        row["transport_s"] = median_transport_s(engine, server.url, args.repeats)
        engine.shutdown()
    with bench_server(path, "ascend_rl_hccl") as server:
        engine = trainer_engine("ascend_rl_hccl", server.url, model)
        row["hccl_s"] = e2e_s(engine, args.repeats)
        engine.shutdown()
    bound, speedup = row["transport_s"] / row["memcpy_s"], row["hccl_s"] / row["ipc_s"]
    print(
        "\n| GB | memcpy s | IPC transport s | transport / memcpy | IPC e2e s | HCCL e2e s "
        "| HCCL / IPC |"
    )
    print("|---|---|---|---|---|---|---|")
    print(
        f"| {nbytes / 1e9:.2f} | {row['memcpy_s']:.3f} | {row['transport_s']:.3f} | "
        f"{bound:.2f} | {row['ipc_s']:.3f} | {row['hccl_s']:.3f} | {speedup:.2f}x |"
    )
    print(f"\ntarget transport <= 2x memcpy: {bound:.2f}x ({'met' if bound <= 2 else 'NOT met'})")
    print(
        f"target IPC e2e faster than HCCL: {speedup:.2f}x ({'met' if speedup > 1 else 'NOT met'})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
