"""Tensor parallel 2 on CPU, one TP=2 server with the NPU-IPC engine: a sync with two trainer
ranks (paused, and unpaused between two tokens), and sleep in every worker. No pause matrix:
a TP=2 engine has one engine core, and its scheduler's matrix is test_pause_resume.py's; a
pause that must reach several engine cores is test_data_parallel.py's.

vLLM's CPU build runs TP over its multiprocessing executor, one worker process per rank. On
this one-NUMA-node host each rank needs its own core by hand (``VLLM_CPU_OMP_THREADS_BIND``).
Every engine worker and every trainer rank emulates a chip of its own (``cpu0``, ``cpu1``), so
NPU IPC's per-chip routing runs exactly as on NPUs: the sender ships ``{chip: handles}`` and
``{chip: doorbell}``, and each worker maps its own chip's ring. (HCCL to several workers:
test_data_parallel.py, whose group is the trainer and two engines' workers.) The reference for
synced weights is the same engine loading the checkpoint from disk with vLLM's own
``reload_weights``, which is what a fresh TP=2 engine on the new weights would hold.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support import (
    TinyModelSpec,
    VLLMServer,
    build_model_pair,
    free_port,
    greedy_token_ids,
    rl_engine_args,
)
from tests.support.profile import current_profile, trainer_env
from tests.support.rl_step import check_continuations, swap_unpaused
from tests.support.trainer import TrainerError, TrainerProcess
from vllm_ascend_rl.client import EngineControlClient

pytestmark = [pytest.mark.e2e, pytest.mark.ascend, pytest.mark.timeout(900)]

BACKEND = "ascend_rl_npu_ipc"
# ~120 MB of weights, so what a level-2 sleep frees per worker stands out. float32: in bf16 the
# ranks' partial sums round with the batch's shape, and a stream recomputed after a sync could
# part from its reference at a near-tie (CI once: one stream of four, the other three and the
# probe exact on v2); float32 makes such ties some thousand times rarer.
SPEC = TinyModelSpec(
    num_layers=4,
    hidden_size=768,
    num_heads=12,
    num_kv_heads=12,
    intermediate_size=2048,
    dtype="float32",
)
KV_GIB = 1
PROBE = "Tensor parallel:"


@pytest.fixture(scope="module")
def models():
    return build_model_pair(SPEC)


def tp2_engine(log_dir: Path) -> list[VLLMServer]:
    return [
        VLLMServer(
            build_model_pair(SPEC)[0],
            log_path=log_dir / "engine-tp2.log",
            env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},  # one core per TP rank on a CPU host
            kv_cache_gib=KV_GIB,
            chips=2,
            dtype=SPEC.dtype,
            extra_args=[
                *rl_engine_args(BACKEND, sleepable=True),
                *("--tensor-parallel-size", "2"),
                *("--enable-prefix-caching", "--enable-prompt-tokens-details"),  # pause tests
            ],
        )
    ]


SERVERS = (tp2_engine,)


@pytest.fixture(scope="module")
def server(server_plan):
    with server_plan.serving(tp2_engine) as (srv,):
        yield srv


@pytest.fixture
def ctl(server):
    client = EngineControlClient(server.url, timeout_s=300)
    client.resume()
    assert client.is_paused() is False
    yield client
    if client.is_sleeping():
        client.wake_up()
    client.resume()


def together(*calls: Callable[[], Any]) -> list[Any]:
    """Run ``calls`` at once (each trainer rank blocks until the others join)."""
    results: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except BaseException as e:
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


@pytest.fixture(scope="module")
def ranks(server, models, tmp_path_factory) -> Iterator[tuple[TrainerProcess, TrainerProcess]]:
    """Two trainer processes on v2, one a chip, in one torch.distributed group."""
    logs = tmp_path_factory.mktemp("tp2-trainers")
    port = free_port()
    env0, env1 = (trainer_env(server.chips, colocated=True, rank=r) for r in (0, 1))
    with (
        TrainerProcess(models[1], log_path=logs / "rank0.log", env=env0) as r0,
        TrainerProcess(models[1], log_path=logs / "rank1.log", env=env1) as r1,
    ):
        together(lambda: r0.join_ranks(port, 0, 2), lambda: r1.join_ranks(port, 1, 2))
        yield r0, r1


@contextmanager
def connected(ranks, server: VLLMServer, models) -> Iterator[None]:
    """Both ranks own the engine's weight channel until the block ends; then the engine is
    back on v1 and the channel free."""
    r0, r1 = ranks
    together(
        lambda: r0.init(BACKEND, server.url, rank=0, timeout_s=60),
        lambda: r1.init(BACKEND, server.url, rank=1, timeout_s=60),
    )
    try:
        yield
    finally:
        together(lambda: r0.release(server.url), lambda: r1.release(server.url))
        EngineControlClient(server.url, timeout_s=300).reload_weights(str(models[0]))


def workers_memory(server: VLLMServer) -> list[dict[str, int]]:
    """Per TP worker: bytes its process holds (CPU: resident set) and its sleep pool."""
    return EngineControlClient(server.url).collective_rpc("memory_in_use")[0]


def weight_bytes() -> int:
    return SPEC.num_parameters() * getattr(torch, SPEC.dtype).itemsize


def test_server_has_two_workers(server, ctl):
    assert ctl.world_size() == 2
    assert len(workers_memory(server)) == 2


def test_one_trainer_rank_cannot_serve_two_chips(server, models, tmp_path):
    env = trainer_env(server.chips, colocated=True)
    with (
        TrainerProcess(models[1], log_path=tmp_path / "alone.log", env=env) as alone,
        pytest.raises(
            TrainerError,
            match=f"no trainer rank on chip {current_profile().chip_name(server.chips[1])}",
        ),
    ):
        alone.init(BACKEND, server.url, timeout_s=30)
    assert server.is_healthy()


def test_each_rank_fills_its_own_chips_ring(server, ctl, ranks, models):
    r0, r1 = ranks
    v1 = greedy_token_ids(server.url, PROBE, 24)
    with connected(ranks, server, models):
        sent, _ = together(lambda: r0.send(weight_version="v2"), lambda: r1.send())
        assert sent["bytes"] > 0
        synced = greedy_token_ids(server.url, PROBE, 24)
        assert synced != v1
        ctl.reload_weights(str(models[1]))  # vLLM's own reload from disk: the reference
        assert greedy_token_ids(server.url, PROBE, 24) == synced
    assert greedy_token_ids(server.url, PROBE, 24) == v1
    log = server.log_path.read_text(errors="replace")
    assert "NPU-IPC weight transfer ready: worker 0" in log
    assert "NPU-IPC weight transfer ready: worker 1" in log


def test_an_unpaused_sync_reaches_both_ranks_between_two_tokens(server, ctl, ranks, models):
    """No pause: each worker process announces its open update to the engine core's scheduler,
    which runs no step until both are whole again; every stream then continues exactly on v2."""
    r0, r1 = ranks
    v1 = greedy_token_ids(server.url, PROBE, 16)
    with connected(ranks, server, models):
        # 600 tokens a stream: with 200 the streams could end before a sync that two
        # workers on two busy cores made slow (CI once: every stream was v1 to its end).
        out = swap_unpaused(
            server.url,
            lambda: together(
                lambda: r0.send(weight_version="v2", pause=False),
                lambda: r1.send(pause=False),
            ),
        )
        assert not out.problems, out.problems
        synced = greedy_token_ids(server.url, PROBE, 16)
        assert synced != v1
        ctl.reload_weights(str(models[1]))  # a fresh TP=2 load of v2 from disk: the reference
        assert greedy_token_ids(server.url, PROBE, 16) == synced
        assert check_continuations(server.url, out, together=True) == [True] * len(out.streams)
    assert greedy_token_ids(server.url, PROBE, 16) == v1
    print(f"\nTP=2 unpaused sync: {out.sync_ms:.0f} ms, streams left v1 at {out.split}")


def test_sleep_levels_free_memory_in_every_worker(server, ctl, models):
    baseline = greedy_token_ids(server.url, PROBE, 16)
    awake = workers_memory(server)
    ctl.sleep(1)
    level1 = workers_memory(server)
    kv_freed = [a["bytes"] - s["bytes"] for a, s in zip(awake, level1, strict=True)]
    ctl.wake_up()
    assert greedy_token_ids(server.url, PROBE, 16) == baseline
    ctl.sleep(2)
    level2 = workers_memory(server)
    weights_freed = [s1["bytes"] - s2["bytes"] for s1, s2 in zip(level1, level2, strict=True)]
    print(
        f"\nper worker: level 1 freed {[f >> 20 for f in kv_freed]} MiB, level 2 "
        f"{[f >> 20 for f in weights_freed]} MiB more (weights {weight_bytes() >> 20} MiB)"
    )
    for freed in kv_freed:  # each rank's KV cache (VLLM_CPU_KVCACHE_SPACE is per rank)
        assert freed >= 0.9 * (KV_GIB << 30), kv_freed
    for freed in weights_freed:  # each rank's shard of the weights
        assert freed >= 0.5 * weight_bytes() / 2, weights_freed
    ctl.wake_up(["weights"])
    ctl.reload_weights(str(models[0]))
    ctl.wake_up(["kv_cache"])
    assert greedy_token_ids(server.url, PROBE, 16) == baseline
