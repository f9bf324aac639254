"""The doctor on this host's real CPU stack (every check listed, the NPU-only ones skipped) and
its ``--engine`` checks against real servers: the session's RL engine passes; a
server started without ``VLLM_SERVER_DEV_MODE=1`` and vLLM's own engine (no plugin scheduler,
no weight-transfer backend) each fail naming the fix. (Two engines of different world sizes:
test_data_parallel.py, which has the DP=2 server.) The ``--engine`` checks are HTTP only: past
the first run, they run in this process."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import VLLMServer, build_model_pair, engine_args
from tests.support.doctor import doctor, engine_checks
from tests.support.standin_vllm_ascend import real_vllm_ascend_installed

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

NPU_ONLY = [f"stack: {n}" for n in ("vllm-ascend", "torch_npu", "CANN and chips", "ACL back end")]
NPU_ONLY += ["environment: NZ weight format"]
LOCAL = (  # every other check of this host
    "stack: python",
    "stack: torch",
    "stack: vllm",
    "stack: device",
    "stack: supported stack",
    "registration: vllm.general_plugins",
    "registration: vllm.stat_logger_plugins",
    "registration: vllm-ascend plugin",
    "registration: WeightTransferEngineFactory 'ascend_rl_hccl'",
    "registration: WeightTransferTrainerFactory 'ascend_rl_hccl'",
    "registration: WeightTransferEngineFactory 'ascend_rl_npu_ipc'",
    "registration: WeightTransferTrainerFactory 'ascend_rl_npu_ipc'",
    "registration: SleepModeBackendFactory 'ascend_rl_camem'",
    "environment: RANK_TABLE_FILE",
    "environment: HCCL_CONNECT_TIMEOUT",
    "environment: HCCL_EXEC_TIMEOUT",
    "environment: PYTORCH_NPU_ALLOC_CONF",
    "environment: VLLM_SERVER_DEV_MODE",
)


def no_dev_mode_engine(log_dir: Path) -> list[VLLMServer]:
    return [
        VLLMServer(
            build_model_pair()[0],
            env={"VLLM_SERVER_DEV_MODE": "0"},
            log_path=log_dir / "no-dev-mode.log",
            extra_args=engine_args(),
        )
    ]


SERVERS = (no_dev_mode_engine,)


@pytest.fixture(scope="module")
def no_dev_mode(server_plan):
    with server_plan.serving(no_dev_mode_engine) as (server,):
        yield server


def test_the_cpu_stack_and_the_rl_engine_pass(rl_engines):
    url = rl_engines("ascend_rl_hccl").url
    code, checks = doctor("--engine", url)
    area = f"engine {url}"
    assert code == 0, [c for c in checks.values() if c["status"] == "fail"]
    assert {n for n in checks if not n.startswith("engine")} == {*LOCAL, *NPU_ONLY}
    for name in LOCAL:
        assert checks[name]["status"] in ("ok", "warn"), checks[name]
    assert checks["stack: supported stack"]["status"] == "ok", checks["stack: supported stack"]
    if not real_vllm_ascend_installed():
        for name in NPU_ONLY:
            assert checks[name]["status"] == "skipped", checks[name]
            assert checks[name]["found"] == "skipped (no NPU)"
    for name, found in (
        ("reachable", "/health 200"),
        ("dev mode", "the RL routes answer"),
        ("state", "generating, awake"),
        ("world size", "1 engine worker(s)"),
        ("weight transfer", "ascend_rl_hccl"),
        ("addresses", "every tensor where the engine started it"),
    ):
        assert checks[f"{area}: {name}"] == {
            "area": area,
            "name": name,
            "status": "ok",
            "found": found,
            "fix": "",
        }
    assert checks[f"{area}: scheduler"]["status"] == "ok"


def test_a_server_without_dev_mode_and_a_plain_vllm_engine_fail(
    rl_engines, reference_v1, no_dev_mode
):
    rl, plain, bare = rl_engines("ascend_rl_hccl").url, reference_v1.url, no_dev_mode.url
    checks = engine_checks(rl, plain, bare)
    failed = {n: c for n, c in checks.items() if c["status"] == "fail"}
    assert set(failed) == {f"engine {bare}: dev mode", f"engine {plain}: scheduler"}
    assert "VLLM_SERVER_DEV_MODE=1" in failed[f"engine {bare}: dev mode"]["fix"]
    assert "--scheduler-cls vllm_ascend_rl" in failed[f"engine {plain}: scheduler"]["fix"]
    assert checks["engines: same model"]["status"] == "ok"  # the same tiny model everywhere
