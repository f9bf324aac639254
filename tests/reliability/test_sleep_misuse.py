"""Routes a client may send while the engine sleeps, against a real server with the sleepable
worker and the plugin scheduler. The engine must never step on memory that is not resident,
must survive every call, and a wake must never drop a pause the trainer holds. Intact is checked
on greedy tokens, not on /health.
"""

from __future__ import annotations

import time

import pytest
import requests

from vllm_ascend_rl.client import EngineControlClient, EngineControlError
from vllm_ascend_rl.compat import has_route
from vllm_ascend_rl.testing import (
    PLUGIN_SCHEDULER,
    StreamingCompletion,
    VLLMServer,
    engine_args,
    greedy_token_ids,
)
from vllm_ascend_rl.testing.profile import current_profile

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.reliability,
    pytest.mark.ascend,
    pytest.mark.timeout(600),
]

PROBE = "Sleep misuse:"
REFUSED = "refusing to resume generation"


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("sleep-misuse") / "server.log"
    srv = VLLMServer(
        tiny_model,
        log_path=log,
        extra_args=[
            *engine_args(),
            "--worker-cls",
            current_profile().sleepable_worker,
            "--scheduler-cls",
            PLUGIN_SCHEDULER,
        ],
    )
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def baseline(server):
    return greedy_token_ids(server.url, PROBE, 16)


@pytest.fixture
def ctl(server, tiny_model, baseline):
    client = EngineControlClient(server.url, timeout_s=300)
    yield client
    if client.is_sleeping():  # leave the engine awake, with valid weights, and resumed
        try:
            client.wake_up(["weights"])
        except EngineControlError:
            pass
        client.reload_weights(str(tiny_model))
        client.wake_up()
    client.resume()
    assert greedy_token_ids(server.url, PROBE, 16) == baseline


def _resume(server) -> requests.Response:
    return requests.post(server.url + "/resume", timeout=60)


@pytest.mark.parametrize("level", [1, 2])
def test_resume_while_asleep_is_refused_and_requests_wait(server, ctl, baseline, tiny_model, level):
    ctl.sleep(level)
    waiting = StreamingCompletion(server.url, PROBE, 16, ignore_eos=False)
    waiting.start()
    r = _resume(server)
    assert r.status_code >= 400 and REFUSED in r.text, r.text
    time.sleep(1.0)
    assert waiting.is_alive() and waiting.num_tokens == 0, "a request ran while asleep"
    assert server.is_healthy() and ctl.is_sleeping() is True
    if level == 2:
        ctl.wake_up(["weights"])
        ctl.reload_weights(str(tiny_model))
        r = _resume(server)  # the KV cache still sleeps
        assert r.status_code >= 400 and REFUSED in r.text, r.text
        ctl.wake_up(["kv_cache"])
    else:
        ctl.wake_up()
    waiting.join(120)
    assert waiting.ok and waiting.token_ids == baseline


@pytest.mark.skipif(
    not has_route("/release_kv_cache_memory"),
    reason="vLLM 0.27.1 has no /release_kv_cache_memory (selective discard came later)",
)
def test_resume_after_release_kv_cache_memory_is_refused(server, ctl, baseline):
    ctl.pause("wait")
    r = requests.post(server.url + "/release_kv_cache_memory", timeout=120)
    assert r.status_code == 200, r.text
    r = _resume(server)
    assert r.status_code >= 400 and REFUSED in r.text, r.text
    assert server.is_healthy()
    ctl.wake_up(["kv_cache"])
    assert ctl.is_paused() is True  # the pause taken before the release is still in force
    ctl.resume()
    assert greedy_token_ids(server.url, PROBE, 16) == baseline


@pytest.mark.parametrize("mode", ["keep", "abort"])
def test_wake_up_keeps_a_pause_taken_before_sleep(server, ctl, baseline, mode):
    ctl.pause(mode)
    ctl.sleep(1)
    waiting = StreamingCompletion(server.url, PROBE, 16, ignore_eos=False)
    waiting.start()
    ctl.wake_up()
    assert ctl.is_paused() is True
    time.sleep(1.0)
    assert waiting.is_alive() and waiting.num_tokens == 0, "the wake dropped the pause"
    ctl.resume()
    waiting.join(120)
    assert waiting.ok and waiting.token_ids == baseline


def test_wake_up_on_an_awake_paused_engine_keeps_the_pause(server, ctl, baseline):
    ctl.pause("keep")
    ctl.wake_up()
    assert ctl.is_paused() is True
    ctl.resume()
    assert ctl.is_paused() is False


def test_sleep_without_a_pause_resumes_on_wake(server, ctl, baseline):
    ctl.sleep(1)
    ctl.wake_up()
    assert ctl.is_paused() is False and ctl.is_sleeping() is False
    assert greedy_token_ids(server.url, PROBE, 16) == baseline
