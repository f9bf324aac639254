"""Worker extension for benchmarks (``--worker-extension-cls``), reached through
``POST /collective_rpc`` (string arguments): transfers on the weight-transfer engine's own
connection that skip loading, and loads that skip the transport, so a benchmark separates
the transport from vLLM's layerwise reload. They use the engine's own link to its trainer
(its handshake, ``agree``, and bucket stream, ``buckets``) and update session, and are not part
of the package."""

from __future__ import annotations

import json
import time

import torch

from vllm_ascend_rl.weight_transfer.wire import Verdict, plan_for


class WeightSyncBenchExtension:
    def bench_raw_receive(self, nbytes: str) -> float:
        """Receive one broadcast of ``nbytes`` bytes on the HCCL engine's channel; seconds."""
        engine = self.weight_transfer_engine
        buf = getattr(self, "_bench_raw_buf", None)
        if buf is None or buf.numel() != int(nbytes):  # reused: the bound is a warm buffer
            buf = self._bench_raw_buf = torch.zeros(
                int(nbytes), dtype=torch.uint8, device=engine.device
            )
        with engine.lock:
            channel = engine.connection.link().channel
            t0 = time.perf_counter()
            channel.wait(channel.broadcast(buf), "raw benchmark broadcast")
            return time.perf_counter() - t0

    def bench_receive_discard(self, update_info: str, keep: str = "") -> float:
        """One update's handshake and every bucket received, nothing loaded; seconds.
        ``keep`` (non-empty): keep the buckets for :meth:`bench_load_only`."""
        engine = self.weight_transfer_engine
        info = engine.parse_update_info(json.loads(update_info))
        plan = plan_for(engine.init_info, info.specs, engine.alone_bytes)
        kept = []
        with engine.lock:
            link = engine.connection.link()
            t0 = time.perf_counter()
            link.agree(Verdict.GO, None, plan, info)
            for bucket, buf in link.buckets(plan):
                if keep:
                    kept.append((bucket, buf.clone()))
                del buf  # as a real update: the transport may check the buffer was released
            seconds = time.perf_counter() - t0
        if keep:  # a transport-only round must not drop what load_only replays
            self._bench_kept = kept
        return seconds

    def bench_load_only(self) -> float:
        """The kept buckets through the update's loading path (start, layerwise reload of each
        bucket, finish), nothing received; seconds."""
        engine, kept = self.weight_transfer_engine, getattr(self, "_bench_kept", None)
        if not kept:
            raise RuntimeError("nothing kept: call bench_receive_discard(keep='1') first")
        session = engine.session
        t0 = time.perf_counter()
        session.start()
        try:
            session.receive(None)
            session.load_all(iter(kept), sum(bucket.nbytes for bucket, _ in kept))
        except BaseException as e:
            session.fail(e)
            raise
        session.finish()
        return time.perf_counter() - t0
