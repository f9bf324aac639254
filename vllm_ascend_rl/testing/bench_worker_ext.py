"""Worker extension for benchmarks (``--worker-extension-cls``): transfers on the HCCL engine's
own channel that skip loading, so a benchmark can separate the transport from vLLM's reload.
Reached through ``POST /collective_rpc`` (arguments travel as strings)."""

from __future__ import annotations

import json
import time

import torch


class WeightSyncBenchExtension:
    def bench_raw_receive(self, nbytes: str) -> float:
        """Receive one broadcast of ``nbytes`` bytes on the HCCL engine's channel; seconds."""
        engine = self.weight_transfer_engine
        buf = getattr(self, "_bench_raw_buf", None)
        if buf is None or buf.numel() != int(nbytes):  # reused: the bound is a warm buffer
            buf = self._bench_raw_buf = torch.zeros(
                int(nbytes), dtype=torch.uint8, device=engine.device
            )
        t0 = time.perf_counter()
        engine.channel.wait(engine.channel.broadcast(buf), "raw benchmark broadcast")
        return time.perf_counter() - t0

    def bench_receive_discard(self, update_info: str) -> float:
        """Receive a whole update exactly as ``receive_weights`` does, minus the loading."""
        from vllm_ascend_rl.weight_transfer.hccl import _plan
        from vllm_ascend_rl.weight_transfer.validation import parse_specs

        engine = self.weight_transfer_engine
        info = json.loads(update_info)
        specs = parse_specs(info["names"], info["dtype_names"], info["shapes"])
        plan = _plan(specs, engine.init_info.packed, engine.init_info.packed_buffer_size_bytes)
        t0 = time.perf_counter()
        for _ in engine._receive(engine.channel, plan):
            pass
        return time.perf_counter() - t0
