"""Pieces shared by the benchmark scripts: the >= 1 GB model, a benchmark server, trainer
engines for either backend, and the transport-only measurement."""

from __future__ import annotations

import itertools
import json
import math
import os
import statistics
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import requests
import torch
from vllm.distributed.weight_transfer import (
    HTTPVLLMWeightSyncClient,
    ModuleSource,
    WeightTransferTrainerFactory,
)

from tests.support import TinyModelSpec, VLLMServer, free_port
from vllm_ascend_rl.client import EngineControlClient

# The extension lives beside this file; the benchmark servers find it on PYTHONPATH.
EXT = "bench_worker_ext.WeightSyncBenchExtension"
HERE = os.path.dirname(os.path.abspath(__file__))


# ~0.21 GB of bf16 weights: big enough that a decode step and a sync are not all overhead,
# small enough for two servers on 2 cores (pause_latency.py, scale_out.py).
MEDIUM_SPEC = TinyModelSpec(
    seed=1, num_layers=8, hidden_size=1024, num_heads=16, num_kv_heads=16, intermediate_size=2816
)


def big_spec(layers: int = 10) -> TinyModelSpec:
    """~1.03 GB of bf16 weights in 10 layers of a 2048-wide Qwen2 (123 tensors)."""
    return TinyModelSpec(
        seed=1,
        num_layers=layers,
        hidden_size=2048,
        num_heads=32,
        num_kv_heads=32,
        intermediate_size=5632,
    )


def model_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def bench_server(path, backend: str) -> VLLMServer:
    return VLLMServer(
        path,
        max_model_len=512,
        extra_args=[
            "--enforce-eager",
            "--max-num-seqs",
            "4",
            "--weight-transfer-config",
            json.dumps({"backend": backend}),
            "--worker-extension-cls",
            EXT,
        ],
        env={"PYTHONPATH": os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")]))},
    )


def step_ms(streams: Iterable, since: float, until: float = math.inf) -> float:
    """Median interval between consecutive tokens of a stream (``token_times``) in
    [since, until), over every stream."""
    gaps = []
    for s in streams:
        times = [t for t in list(s.token_times) if since <= t < until]
        gaps += [b - a for a, b in itertools.pairwise(times) if b > a]
    if not gaps:  # a host so slow (or loaded) that no stream got two tokens in the window
        raise RuntimeError("no stream received two tokens in the window: the host is too busy")
    return 1e3 * statistics.median(gaps)


def rtt_ms(url: str) -> float:
    """One HTTP round trip to the server at ``url`` (``GET /v1/models``, median of 5)."""
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        requests.get(url + "/v1/models", timeout=30).raise_for_status()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def init_hccl_trainer(trainer, url: str) -> None:
    """A ``tests.support.trainer.TrainerProcess`` on the HCCL backend, rank 0 of 2 (one
    engine worker), bound to the engine at ``url``."""
    trainer.init(
        "ascend_rl_hccl",
        url,
        master_address="127.0.0.1",
        master_port=free_port(),
        world_size=2,
        timeout_s=120,
    )


@contextmanager
def paused(*urls: str) -> Iterator[None]:
    """The engines paused (``keep``) inside the block, as an RL loop syncs them: the sync's time
    then excludes waiting for steps in flight."""
    ctl = EngineControlClient(list(urls))
    ctl.pause("keep")
    try:
        yield
    finally:
        ctl.resume()


def trainer_engine(backend: str, url: str, model: torch.nn.Module, **init):
    """``trainer_init`` through vLLM's factory, as a user would."""
    init.setdefault("timeout_s", 600)
    if backend == "ascend_rl_hccl":
        from vllm_ascend_rl.weight_transfer.hccl import HCCLTrainerInitInfo

        info = HCCLTrainerInitInfo(
            master_address="127.0.0.1", master_port=free_port(), world_size=2, rank=0, **init
        )
    else:
        from vllm_ascend_rl.weight_transfer.npu_ipc import NPUIPCTrainerInitInfo

        info = NPUIPCTrainerInitInfo(rank=0, **init)
    return WeightTransferTrainerFactory.trainer_init(
        info, client=HTTPVLLMWeightSyncClient(url, timeout=600), source=ModuleSource(model)
    )


def transport_s(engine, url: str, keep: bool = False) -> float:
    """Trainer-side seconds of one update's data plane with a receiver that does not load:
    the engine runs the same handshake and receive (or copy-out) path, minus layerwise
    reload (the engines' public transport probes). ``keep``: the engine keeps the buckets
    for :func:`load_only_s`."""

    def receive(payload: dict) -> None:
        kwargs = {"update_info": json.dumps(payload), "keep": "1" if keep else ""}
        r = requests.post(
            url + "/collective_rpc",
            json={"method": "bench_receive_discard", "kwargs": kwargs},
            timeout=600,
        )
        r.raise_for_status()

    return send_transport_only(engine, receive)


def send_transport_only(engine, receive) -> float:
    """Send one update's buckets through a trainer engine's own handshake and data plane to
    engines that receive without loading; trainer-side seconds of the data plane.
    ``receive(payload)`` makes every engine worker run ``bench_receive_discard(payload)``
    (in the background while this rank sends)."""
    from vllm_ascend_rl.weight_transfer.trainer_side import BackgroundCall, source_specs
    from vllm_ascend_rl.weight_transfer.wire import Verdict, plan_for

    specs = source_specs(engine.source)
    plan = plan_for(engine.init_info, specs, engine.alone_bytes)
    receiving = BackgroundCall("receive_transport_only", receive, engine.payload(specs, plan))
    if engine.agree(plan, receiving) != Verdict.GO:
        raise RuntimeError(f"transport probe refused: {receiving.failure(30)}")
    t0 = time.perf_counter()
    engine.send(plan, iter(engine.source), receiving)
    seconds = time.perf_counter() - t0
    receiving.result(engine.init_info.timeout_s)
    return seconds


def load_only_s(url: str) -> float:
    """Engine-side seconds to load the buckets kept by ``transport_s(keep=True)`` through the
    update's loading path, nothing received (the slowest worker)."""
    r = requests.post(
        url + "/collective_rpc", json={"method": "bench_load_only", "kwargs": {}}, timeout=600
    )
    r.raise_for_status()
    return max(float(x) for x in r.json()["results"])  # the route stringifies results
