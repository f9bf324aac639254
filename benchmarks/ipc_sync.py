"""NPU-IPC weight sync vs its memcpy bound and vs the HCCL engine, on a >= 1 GB bf16 model.

In one run (this script is the trainer, colocated with the vLLM worker):

  memcpy      one copy of the model's total bytes between two warm buffers
  tensors     the model's own tensors copied once into one warm buffer (the bound: the least
              a staging transport does; it reads the same scattered tensors)
  transport   ``send_weights`` data plane: handles, staging copies, the engine's copy-out,
              doorbells; the engine does not load (no layerwise reload)
  IPC e2e     ``send_weights`` end to end (start -> update -> finish, layerwise reload)
  HCCL e2e    the HCCL engine's ``send_weights`` end to end on the same model

All five run in interleaved rounds (benchmarks/rounds.py), with both servers up. Targets:
transport <= 1.5x the tensors copy (the ratio to the flat memcpy is printed too); IPC end to
end faster than HCCL. On CPU, NPU IPC is POSIX shared memory and HCCL is gloo over loopback.

    PYTHONPATH=. python benchmarks/ipc_sync.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from bench_common import (
    bench_server,
    big_spec,
    model_bytes,
    paused,
    trainer_engine,
    transport_s,
)
from charts import ipc_sync_chart
from rounds import Target, interleaved, median, report, spread

import vllm_ascend_rl
from tests.support import build_tiny_model, serving
from tests.support.tiny_model import load_hf_model
from vllm_ascend_rl.device import Device, current_device
from vllm_ascend_rl.weight_transfer.buckets import as_bytes

IPC, HCCL = "ascend_rl_npu_ipc", "ascend_rl_hccl"
SETTLE_S = 1.0  # right after an update the engines' worker threads still hold the cores


def settled(fn):
    """``fn`` measured once the engines' threads are idle again (the wait is not timed): the
    copies and the transport are measured beside idle engines, as the bound is."""

    def run():
        time.sleep(SETTLE_S)
        return fn()

    return run


def memcpy_s(device: Device, dst: torch.Tensor, src: torch.Tensor) -> float:
    """One copy between two warm buffers, as the staging copy does it."""
    t0 = time.perf_counter()
    device.copy_bytes(dst, src)
    device.synchronize()
    return time.perf_counter() - t0


def tensors_copy_s(device: Device, dst: torch.Tensor, model: torch.nn.Module) -> float:
    """The model's own tensors copied once, back to back into one warm buffer: the least
    any staging transport does (it reads the same scattered tensors, not one buffer)."""
    t0, off = time.perf_counter(), 0
    for p in model.parameters():
        src = as_bytes(p.detach())
        device.copy_bytes(dst[off : off + src.numel()], src)
        off += src.numel()
    device.synchronize()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)  # rounds are cheap here
    args = ap.parse_args()
    vllm_ascend_rl.register()
    path = build_tiny_model(big_spec())
    model = load_hf_model(path)
    nbytes = model_bytes(model)
    print(f"model: {nbytes / 1e9:.2f} GB bf16; starting two vLLM servers ...", flush=True)
    device = current_device()
    src = torch.ones(nbytes, dtype=torch.uint8, device=device.torch_device())
    dst = torch.zeros_like(src)
    with (
        serving(bench_server(path, IPC), bench_server(path, HCCL)) as (ipc_server, hccl_server),
        paused(ipc_server.url, hccl_server.url),
    ):
        ipc = trainer_engine(IPC, ipc_server.url, model)
        hccl = trainer_engine(HCCL, hccl_server.url, model)
        try:
            ipc.send_weights(), hccl.send_weights()  # warm every buffer on both sides
            runs = interleaved(
                {
                    # The bound is measured beside the idle engines, as the transport is.
                    "memcpy": settled(lambda: memcpy_s(device, dst, src)),
                    "tensors": settled(lambda: tensors_copy_s(device, dst, model)),
                    "transport": settled(lambda: transport_s(ipc, ipc_server.url)),
                    "ipc": lambda: ipc.send_weights().seconds,
                    "hccl": lambda: hccl.send_weights().seconds,
                },
                args.rounds,
            )
        finally:
            ipc.shutdown()
            hccl.shutdown()
    bound = Target.of(
        "IPC transport / copy of the model's tensors", runs["transport"], runs["tensors"], 1.5
    )
    flat = Target.of("IPC transport / memcpy", runs["transport"], runs["memcpy"], 1.5)
    faster = Target.of("HCCL e2e / IPC e2e", runs["hccl"], runs["ipc"], 1.0, at_least=True)
    print(
        f"\nNPU-IPC sync of {nbytes / 1e9:.2f} GB bf16, {args.rounds} interleaved rounds "
        "(median ±spread, s)\n"
    )
    print(
        "| memcpy | tensors copy | IPC transport | transport / tensors copy | transport / "
        "memcpy | IPC e2e | HCCL e2e | HCCL / IPC |"
    )
    print("|---|---|---|---|---|---|---|---|")

    def cell(key: str) -> str:
        return f"{median(runs[key]):.3f} ±{spread(runs[key]):.3f}"

    print(
        f"| {cell('memcpy')} | {cell('tensors')} | {cell('transport')} | "
        f"{bound.median:.2f} ±{bound.spread:.2f} | {flat.median:.2f} ±{flat.spread:.2f} | "
        f"{cell('ipc')} | {cell('hccl')} | {faster.median:.2f} ±{faster.spread:.2f} |"
    )
    print(f"\n(informative) {flat.line()}")
    ipc_sync_chart(runs, nbytes / 1e9, args.rounds)
    return report([bound, faster])


if __name__ == "__main__":
    sys.exit(main())
