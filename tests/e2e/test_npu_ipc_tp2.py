"""NPU IPC with TP = 2: one trainer rank per chip, each exporting a ring on its own chip.

On CPU every engine worker and every trainer rank emulates a chip of its own (``cpu0``,
``cpu1``), so the per-chip routing is exercised exactly as on NPUs: the sender ships
``{chip: handles}`` and ``{chip: doorbell}``, and each worker maps its own chip's ring. The
reference is the same engine reloading the checkpoint from disk through vLLM's own
``reload_weights``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support import (
    VLLMServer,
    build_model_pair,
    engine_args,
    free_port,
    greedy_token_ids,
)
from tests.support.profile import current_profile, trainer_env
from tests.support.trainer import TrainerError, TrainerProcess
from vllm_ascend_rl.client import EngineControlClient

pytestmark = [pytest.mark.e2e, pytest.mark.ascend, pytest.mark.timeout(900)]

PROBE = "Tensor parallel weights:"
BACKEND = "ascend_rl_npu_ipc"


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
def models():
    return build_model_pair()


def ipc_tp2_engine(log_dir: Path) -> list[VLLMServer]:
    return [
        VLLMServer(
            build_model_pair()[0],
            log_path=log_dir / "engine.log",
            env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},  # one core per TP rank on a CPU host
            chips=2,
            extra_args=[
                *engine_args(),
                *("--tensor-parallel-size", "2"),
                *("--weight-transfer-config", f'{{"backend": "{BACKEND}"}}'),
            ],
        )
    ]


SERVERS = (ipc_tp2_engine,)


@pytest.fixture(scope="module")
def engine(server_plan):
    with server_plan.serving(ipc_tp2_engine) as (server,):
        yield server


@pytest.fixture(scope="module")
def ranks(engine, models, tmp_path_factory):
    logs = tmp_path_factory.mktemp("tp2-trainers")
    port = free_port()
    env0, env1 = (trainer_env(engine.chips, colocated=True, rank=r) for r in (0, 1))
    with (
        TrainerProcess(models[1], log_path=logs / "rank0.log", env=env0) as r0,
        TrainerProcess(models[1], log_path=logs / "rank1.log", env=env1) as r1,
    ):
        together(lambda: r0.join_ranks(port, 0, 2), lambda: r1.join_ranks(port, 1, 2))
        yield r0, r1


def test_one_trainer_rank_cannot_serve_two_chips(engine, models, tmp_path):
    env = trainer_env(engine.chips, colocated=True)
    with (
        TrainerProcess(models[1], log_path=tmp_path / "alone.log", env=env) as alone,
        pytest.raises(
            TrainerError,
            match=f"no trainer rank on chip {current_profile().chip_name(engine.chips[1])}",
        ),
    ):
        alone.init(BACKEND, engine.url, timeout_s=30)
    assert engine.is_healthy()


def test_each_rank_fills_its_own_chips_ring(engine, ranks, models):
    r0, r1 = ranks
    v1 = greedy_token_ids(engine.url, PROBE, 24)
    together(
        lambda: r0.init(BACKEND, engine.url, rank=0, timeout_s=60),
        lambda: r1.init(BACKEND, engine.url, rank=1, timeout_s=60),
    )
    sent, _ = together(lambda: r0.send(weight_version="v2"), lambda: r1.send())
    assert sent["bytes"] > 0
    synced = greedy_token_ids(engine.url, PROBE, 24)
    assert synced != v1
    ctl = EngineControlClient(engine.url)
    ctl.reload_weights(str(models[1]))  # vLLM's own reload from disk: the reference
    assert greedy_token_ids(engine.url, PROBE, 24) == synced
    ctl.reload_weights(str(models[0]))
    assert greedy_token_ids(engine.url, PROBE, 24) == v1
    log = engine.log_path.read_text(errors="replace")
    assert "NPU-IPC weight transfer ready: worker 0" in log
    assert "NPU-IPC weight transfer ready: worker 1" in log
