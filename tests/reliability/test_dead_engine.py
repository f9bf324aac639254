"""An engine killed mid-sync (SIGKILL of its engine core and workers), seen from the trainer.

Each test kills the session's RL engine of its backend; these tests run after every other
(``kills_shared_servers``), so no other test waits for it to start again. The
trainer stalls mid-transfer, the engine dies during the stall, and ``send_weights`` must fail
within ``timeout_s`` with a message that names the engine, leaving no shared memory behind.
"""

from __future__ import annotations

import os
import time

import pytest

from tests.e2e.weight_sync_cases import SMALL_BUCKET, init_trainer
from tests.support.dead_engine import kill_mid_sync
from tests.support.profile import trainer_env
from tests.support.trainer import TrainerProcess

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.reliability,
    pytest.mark.kills_shared_servers,
    pytest.mark.timeout(600),
]

BACKENDS = ["ascend_rl_hccl", "ascend_rl_npu_ipc"]
USES_COMPILE_MODE_PAIR = True  # the NPU-IPC engine's shared server
TIMEOUT_S = 5


@pytest.fixture(scope="module")
def models(model_pair):
    return model_pair


def shm_of_ours() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("vllm_ascend_rl_")}


@pytest.mark.parametrize("backend", BACKENDS)
def test_engine_killed_mid_sync_fails_the_send_naming_the_engine(
    rl_engines, models, tmp_path, backend
):
    engine = rl_engines(backend)
    env = trainer_env(engine.chips, colocated=backend == "ascend_rl_npu_ipc")
    shm_before = shm_of_ours()
    with TrainerProcess(models[1], log_path=tmp_path / "trainer.log", env=env) as trainer:
        init_trainer(
            backend, trainer, engine, timeout_s=TIMEOUT_S, packed_buffer_size_bytes=SMALL_BUCKET
        )
        kill_mid_sync(trainer, engine, TIMEOUT_S)
    engine.stop(timeout_s=5)  # its API server waits on a request the dead engine never answers
    deadline = time.monotonic() + 10
    while shm_of_ours() - shm_before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not shm_of_ours() - shm_before, "staging segments left in /dev/shm"
