"""Worker extension for benchmarks (``--worker-extension-cls``): transfers on the weight-
transfer engine's own connection that skip loading, so a benchmark can separate the transport
from vLLM's layerwise reload. Reached through ``POST /collective_rpc`` (string arguments)."""

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
        """Run one update's handshake and receive every bucket, without loading; seconds."""
        from vllm_ascend_rl.weight_transfer.validation import parse_specs

        engine = self.weight_transfer_engine
        info = engine.parse_update_info(json.loads(update_info))
        specs = parse_specs(info.names, info.dtype_names, info.shapes)
        t0 = time.perf_counter()
        reason = engine._agree(None, specs, info)
        assert reason is None, reason
        for _bucket, buf in engine._buckets(engine._plan(specs), info):
            del buf  # as receive_weights does: the transport may check it is released
        return time.perf_counter() - t0
