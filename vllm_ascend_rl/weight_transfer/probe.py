"""Probes for benchmarks, which split one update into its two halves on the engines' own
connection and bucket plan: the transport (handshake and data plane, an engine that receives
every bucket and loads nothing) and the load (the same buckets, already in memory, through the
update's loading path: start, layerwise reload of every bucket, finish)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from vllm_ascend_rl.weight_transfer.buckets import TensorSpec
from vllm_ascend_rl.weight_transfer.validation import parse_specs


class EngineTransportProbe:
    """Mixed into the engine-side template (``CheckpointEngine``)."""

    def receive_transport_only(self, update_info: dict[str, Any], keep: bool = False) -> float:
        """Run one update's handshake and receive every bucket, discarding it; seconds.
        ``keep``: keep a copy of every bucket for :meth:`load_only` (the copies are timed).
        A worker extension reaches it through ``/collective_rpc``."""
        info = self.parse_update_info(update_info)
        specs = parse_specs(info.names, info.dtype_names, info.shapes)
        kept = []
        t0 = time.perf_counter()
        reason = self._agree(None, specs, info)
        if reason is not None:
            raise RuntimeError(f"transport probe refused: {reason}")
        for bucket, buf in self._buckets(self._plan(specs), info):
            if keep:
                kept.append((bucket, buf.clone()))
            del buf  # as a real update: the transport may check the buffer was released
        seconds = time.perf_counter() - t0
        if keep:
            self._probe_kept = kept
        return seconds

    def load_only(self) -> float:
        """Load the buckets kept by ``receive_transport_only(keep=True)`` as an update would
        (start, layerwise reload of each bucket, finish), nothing received; seconds."""
        kept = getattr(self, "_probe_kept", None)
        if not kept:
            raise RuntimeError("nothing kept: call receive_transport_only(keep=True) first")
        if self.base is not None:
            raise RuntimeError("load_only replays whole tensors: use an engine without delta")
        t0 = time.perf_counter()
        self.start_weight_update()
        try:
            for bucket, buf in kept:
                self._load(bucket, buf)
        except BaseException:
            self._abort_update()
            raise
        self._received = True
        self.finish_weight_update()
        return time.perf_counter() - t0


class TrainerTransportProbe:
    """Mixed into the trainer-side template (``CheckpointTrainer``)."""

    def send_transport_only(self, receive: Callable[[dict[str, Any]], Any]) -> float:
        """Send one update's buckets to engines that receive without loading; trainer-side
        seconds of the data plane. ``receive(payload)`` must make every engine worker call
        ``receive_transport_only(payload)`` and return once they did (it runs in the
        background while this rank sends)."""
        from vllm_ascend_rl.weight_transfer.trainer_side import BackgroundCall, Progress

        specs = [TensorSpec(m.name, m.dtype, tuple(m.shape)) for m in self.source.metadata()]
        plan = self._plan(specs)
        receiving = BackgroundCall("receive_transport_only", receive, self._payload(specs, plan))
        if not self._agree(specs, receiving):
            raise RuntimeError(f"transport probe refused: {receiving.failure(30)}")
        bar = Progress(0, False, "")
        self._send(plan, iter(self.source), receiving, bar)
        seconds = bar.close()
        receiving.result(self.init_info.timeout_s)
        return seconds
