"""Worker extension for benchmarks (``--worker-extension-cls``), reached through
``POST /collective_rpc`` (string arguments): transfers on the weight-transfer engine's own
connection that skip loading, so a benchmark separates the transport from vLLM's layerwise
reload. Public hooks only: the engine's ``channel`` and ``receive_transport_only``."""

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
        """One update's handshake and every bucket received, nothing loaded; seconds."""
        return self.weight_transfer_engine.receive_transport_only(json.loads(update_info))
