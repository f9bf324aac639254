"""The doctor's ``--engine`` checks against real servers: the session's RL engine passes; a
server started without ``VLLM_SERVER_DEV_MODE=1`` and vLLM's own engine (no plugin scheduler,
no weight-transfer backend) each fail naming the fix. (Two engines of different world sizes:
test_data_parallel.py, which has the DP=2 server.)"""

from __future__ import annotations

import pytest

from tests.support import VLLMServer, engine_args, serving
from tests.support.doctor import doctor

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def no_dev_mode(tmp_path_factory, model_pair):
    server = VLLMServer(
        model_pair[0],
        env={"VLLM_SERVER_DEV_MODE": "0"},
        log_path=tmp_path_factory.mktemp("doctor") / "no-dev-mode.log",
        extra_args=engine_args(),
    )
    with serving(server):
        yield server


def test_the_rl_engine_passes(rl_engines):
    url = rl_engines("ascend_rl_hccl").url
    code, checks = doctor("--engine", url)
    area = f"engine {url}"
    assert code == 0, [c for c in checks.values() if c["status"] == "fail"]
    for name, found in (
        ("reachable", "/health 200"),
        ("dev mode", "the RL routes answer"),
        ("state", "generating, awake"),
        ("world size", "1 engine worker(s)"),
        ("weight transfer", "ascend_rl_hccl"),
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
    code, checks = doctor("--engine", rl, "--engine", plain, "--engine", bare)
    assert code == 1
    failed = {n: c for n, c in checks.items() if c["status"] == "fail"}
    assert set(failed) == {
        f"engine {bare}: dev mode",
        f"engine {plain}: scheduler",
        f"engine {plain}: weight transfer",
    }
    assert "VLLM_SERVER_DEV_MODE=1" in failed[f"engine {bare}: dev mode"]["fix"]
    assert "--scheduler-cls vllm_ascend_rl" in failed[f"engine {plain}: scheduler"]["fix"]
    assert "ascend_rl_hccl" in failed[f"engine {plain}: weight transfer"]["fix"]
    assert checks["engines: same model"]["status"] == "ok"  # the same tiny model everywhere
