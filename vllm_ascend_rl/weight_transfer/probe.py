"""Transport-only probes, for benchmarks: one update's handshake and data plane, with an engine
that receives every bucket and loads nothing. Together they measure the transport apart from
vLLM's layerwise reload, on the engines' own connection and bucket plan."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from vllm_ascend_rl.weight_transfer.buckets import TensorSpec
from vllm_ascend_rl.weight_transfer.validation import parse_specs


class EngineTransportProbe:
    """Mixed into the engine-side template (``CheckpointEngine``)."""

    def receive_transport_only(self, update_info: dict[str, Any]) -> float:
        """Run one update's handshake and receive every bucket, discarding it; seconds.
        A worker extension reaches it through ``/collective_rpc``."""
        info = self.parse_update_info(update_info)
        specs = parse_specs(info.names, info.dtype_names, info.shapes)
        t0 = time.perf_counter()
        reason = self._agree(None, specs, info)
        if reason is not None:
            raise RuntimeError(f"transport probe refused: {reason}")
        for _bucket, buf in self._buckets(self._plan(specs), info):
            del buf  # as a real update: the transport may check the buffer was released
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
