"""Tensor parallel 2 on CPU: the pause matrix, an unpaused HCCL sync and sleep, on one TP=2
server.

vLLM's CPU build runs TP over its multiprocessing executor, one worker process per rank. On
this one-NUMA-node host each rank needs its own core by hand (``VLLM_CPU_OMP_THREADS_BIND``).
The HCCL group is the trainer plus both workers (world size 3). The reference for synced
weights is the same TP=2 engine loading the checkpoint from disk with vLLM's own
``reload_weights``, which is what a fresh TP=2 engine on the new weights would hold.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.e2e.test_pause_resume import (  # the same matrix, run on this module's server
    test_invalid_pause_mode_preserves_state,  # noqa: F401
    test_pause_mode_request_lifecycle,  # noqa: F401
    test_pause_resume_state_is_idempotent_across_cycles,  # noqa: F401
)
from tests.e2e.weight_sync_cases import init_trainer
from tests.support import (
    TinyModelSpec,
    VLLMServer,
    build_model_pair,
    greedy_token_ids,
    rl_engine_args,
)
from tests.support.profile import trainer_env
from tests.support.rl_step import check_continuations, swap_unpaused
from tests.support.trainer import TrainerProcess
from vllm_ascend_rl.client import EngineControlClient

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

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
                *rl_engine_args("ascend_rl_hccl", sleepable=True),
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


def workers_memory(server: VLLMServer) -> list[dict[str, int]]:
    """Per TP worker: bytes its process holds (CPU: resident set) and its sleep pool."""
    return EngineControlClient(server.url).collective_rpc("memory_in_use")[0]


def weight_bytes() -> int:
    return SPEC.num_parameters() * getattr(torch, SPEC.dtype).itemsize


def test_server_has_two_workers(server, ctl):
    assert ctl.world_size() == 2
    assert len(workers_memory(server)) == 2


def test_an_unpaused_hccl_sync_reaches_both_ranks_between_two_tokens(server, ctl, models, tmp_path):
    """No pause: each worker process announces its open update to the engine core's scheduler,
    which runs no step until both are whole again; every stream then continues exactly on v2."""
    v1 = greedy_token_ids(server.url, PROBE, 16)
    env = trainer_env(server.chips, colocated=False)
    try:
        with TrainerProcess(models[1], log_path=tmp_path / "trainer.log", env=env) as trainer:
            init_trainer("ascend_rl_hccl", trainer, server, world_size=3)
            # 600 tokens a stream: with 200 the streams could end before a sync that two
            # workers on two busy cores made slow (CI once: every stream was v1 to its end).
            sync = lambda: trainer.send(weight_version="v2", pause=False)  # noqa: E731
            out = swap_unpaused(server.url, sync)
        assert not out.problems, out.problems
        synced = greedy_token_ids(server.url, PROBE, 16)
        assert synced != v1
        ctl.reload_weights(str(models[1]))  # a fresh TP=2 load of v2 from disk: the reference
        assert greedy_token_ids(server.url, PROBE, 16) == synced
        assert check_continuations(server.url, out, together=True) == [True] * len(out.streams)
        log = server.log_path.read_text(errors="replace")
        for rank in (1, 2):
            assert f"HCCL weight transfer ready: rank {rank} of 3" in log
    finally:  # the module's other tests start from v1
        ctl.reload_weights(str(models[0]))
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
