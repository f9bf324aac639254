"""The HTTP RL examples, run as a user runs them against servers of their own: the session's
shared RL engine of the example's backend (on v1) and its v2 reference. One step each:
``rlhf_http_hccl.py`` streams requests, pauses (keep), broadcasts v2 and resumes;
``rlhf_http_npu_ipc.py`` sleeps (level 2, keep), wakes the weights, syncs v2 through the
staging buffers, wakes the KV cache and resumes. Each example validates its own step (every
request finishes with all its tokens, and each continuation equals the reference's greedy
output from the same prefix) and exits 1 otherwise; this checks its exit status and the lines
that show the validation ran. The example is the trainer; the engine is put back on v1."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import greedy_token_ids
from tests.support.profile import trainer_env
from vllm_ascend_rl.client import EngineControlClient

pytestmark = [pytest.mark.e2e, pytest.mark.ascend, pytest.mark.timeout(600)]
USES_COMPILE_MODE_PAIR = True  # the NPU-IPC engine's shared server and its reference

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PROBE = "Weights under test:"
MAX_TOKENS = 200  # per request: the pause lands a few dozen tokens in, the rest is validated


def put_back_on_v1(shared_servers, engine, v1: Path, v1_probe: list[int]) -> None:
    """Leave the shared engine as the session's other users expect it (resumed, awake, on
    v1), or stopped, to be started anew, if the example left it otherwise."""
    try:
        ctl = EngineControlClient(engine.url)
        ctl.resume()
        ctl.reload_weights(str(v1))  # vLLM's own loader, from disk
        assert greedy_token_ids(engine.url, PROBE, 24) == v1_probe
    except Exception as e:
        print(f"the shared engine could not be put back on v1 ({e}): it is stopped")
        shared_servers.discard(engine)


@pytest.mark.parametrize(
    "backend, script",
    [
        pytest.param("ascend_rl_hccl", "rlhf_http_hccl.py", id="hccl"),
        pytest.param("ascend_rl_npu_ipc", "rlhf_http_npu_ipc.py", id="npu_ipc"),
    ],
)
def test_example_validates_a_sync_mid_generation(
    backend,
    script,
    request,
    report,
    shared_servers,
    rl_engines,
    reference_v1,
    references_v2,
    model_pair,
    standin_env,
    tmp_path,
):
    v1, v2 = model_pair
    engine = rl_engines(backend)
    v1_probe = greedy_token_ids(reference_v1.url, PROBE, 24)
    command = [
        *(sys.executable, str(EXAMPLES / script)),
        *("--device", request.config.getoption("--device")),
        *("--server-url", engine.url, "--model", str(v1)),
        *("--reference-url", references_v2(backend).url, "--train-checkpoints", str(v2)),
        *("--max-tokens", str(MAX_TOKENS)),
    ]
    colocated = backend == "ascend_rl_npu_ipc"
    env = {**os.environ, **standin_env, **trainer_env(engine.chips, colocated=colocated)}
    log = tmp_path / f"{script}.log"
    t0 = time.monotonic()
    try:
        with open(log, "wb") as out:
            proc = subprocess.run(
                command, stdout=out, stderr=subprocess.STDOUT, timeout=300, env=env
            )
    finally:
        put_back_on_v1(shared_servers, engine, v1, v1_probe)
    report(f"examples/{script}: one validated step in {time.monotonic() - t0:.0f} s")
    text = log.read_text(errors="replace")
    assert proc.returncode == 0, text[-4000:]
    row = re.search(r"^\s*1\s+v1->v2\s.*$", text, re.MULTILINE)
    assert row and "PASS 4/4 continuations exact" in row.group(), text[-4000:]
    assert "all steps validated" in text
    print("\n" + row.group())
