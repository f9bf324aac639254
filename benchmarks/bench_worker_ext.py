"""Worker extension for benchmarks (``--worker-extension-cls``), reached through
``POST /collective_rpc`` (string arguments): transfers on the weight-transfer engine's own
connection that skip loading, and loads that skip the transport, so a benchmark separates
the transport from vLLM's layerwise reload. Public hooks only: the engine's ``channel``,
``receive_transport_only`` and ``load_only``."""

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

    def bench_receive_discard(self, update_info: str, keep: str = "") -> float:
        """One update's handshake and every bucket received, nothing loaded; seconds.
        ``keep`` (non-empty): keep the buckets for :meth:`bench_load_only`."""
        engine = self.weight_transfer_engine
        return engine.receive_transport_only(json.loads(update_info), keep=bool(keep))

    def bench_load_only(self) -> float:
        """The kept buckets through the update's loading path, nothing received; seconds."""
        return self.weight_transfer_engine.load_only()
