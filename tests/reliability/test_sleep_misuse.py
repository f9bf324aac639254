"""Routes a client may send while the engine sleeps, against a real server with the sleepable
worker and the plugin scheduler. The engine must never step on memory that is not resident,
must survive every call, and a wake must never drop a pause the trainer holds. Intact is checked
on greedy tokens, not on /health.
"""

from __future__ import annotations

import time

import pytest
import requests

from tests.support import (
    StreamingCompletion,
    greedy_token_ids,
)
from tests.support.addresses import assert_addresses_kept
from tests.support.sleep_servers import leave_awake
from tests.support.vllm_features import has_route
from vllm_ascend_rl.client import EngineControlClient, EngineControlError

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.reliability,
    pytest.mark.ascend,
    pytest.mark.timeout(600),
]

PROBE = "Sleep misuse:"
REFUSED = "refusing to resume generation"


@pytest.fixture(scope="module")
def server(rl_engines):
    """The session's RL engine: the sleepable worker and the plugin scheduler."""
    return rl_engines("ascend_rl_hccl")


@pytest.fixture(scope="module")
def baseline(server):
    return greedy_token_ids(server.url, PROBE, 16)


@pytest.fixture
def ctl(server, tiny_model, baseline, request):
    client = EngineControlClient(server.url, timeout_s=300)
    yield client
    leave_awake(client, tiny_model)
    assert greedy_token_ids(server.url, PROBE, 16) == baseline
    assert_addresses_kept(server.url, request.node.name)


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
    reason="vLLM 0.30.0 has no /release_kv_cache_memory (selective discard came later)",
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


STORM_CALLS = ("pause_abort", "pause_keep", "resume", "sleep", "wake_up")


def _storm_call(ctl: EngineControlClient, call: str) -> str:
    """One control call; what it answered (a refusal is an answer, not a failure)."""
    try:
        if call.startswith("pause_"):
            ctl.pause(call.removeprefix("pause_"))
        elif call == "sleep":
            ctl.sleep(1)
        else:
            getattr(ctl, call)()
        return "ok"
    except EngineControlError as e:
        return f"refused: {e}"


def test_a_storm_of_control_calls_ends_in_the_last_calls_state(server, ctl, baseline):
    """8 threads x 12 calls of pause/resume/sleep/wake_up while 4 streams run, then a final
    wake_up and resume: every stream ends (complete, or aborted by a pause), the engine is
    awake, unpaused, and generates exactly what it did before."""
    import random
    import threading

    streams = [
        StreamingCompletion(server.url, PROBE, 200, ignore_eos=True, timeout_s=600)
        for _ in range(4)
    ]
    for s in streams:
        s.start()
    answers: list[str] = []

    def storm(seed: int) -> None:
        rng = random.Random(seed)
        client = EngineControlClient(server.url, timeout_s=300)
        for _ in range(12):
            answers.append(_storm_call(client, rng.choice(STORM_CALLS)))

    threads = [threading.Thread(target=storm, args=(i,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not any(t.is_alive() for t in threads), "a control call hung"
    assert server.is_healthy()
    unexpected = [a for a in answers if a != "ok" and REFUSED not in a]
    assert not unexpected, unexpected[:3]
    ctl.wake_up()
    ctl.resume()
    assert ctl.is_sleeping() is False and ctl.is_paused() is False
    for s in streams:
        s.join(300)
        assert not s.is_alive(), "a stream never ended"
        assert s.status_code == 200 and s.error is None, s.error
        if s.finish_reason is None:  # upstream: see test_upstream_*_without_a_reason
            assert s.num_tokens == 0, f"a stream ended after {s.num_tokens} tokens, no reason"
            continue
        assert s.finish_reason in ("length", "abort"), s.finish_reason
        if s.finish_reason == "length":
            assert s.num_tokens == 200, "a stream lost or duplicated tokens"
    assert greedy_token_ids(server.url, PROBE, 16) == baseline


# -- upstream vLLM's own behaviour (default scheduler), as docs/failure-semantics.md says ---


@pytest.fixture
def upstream(reference_v1):
    """A client of ``reference_v1``, vLLM's own engine and scheduler, which the session
    shares: left resumed however the test ends."""
    client = EngineControlClient(reference_v1.url)
    yield client
    client.resume()


def test_upstream_wake_up_drops_the_pause_of_an_awake_engine(upstream):
    """vLLM's EngineCore.wake_up resumes scheduling whenever every tag is resident (on an
    engine that never slept, at once), so a trainer's pause is lost; the plugin scheduler
    keeps it (test above)."""
    upstream.pause("keep")
    upstream.wake_up()
    assert upstream.is_paused() is False


def test_upstream_ends_a_stream_aborted_before_its_first_token_without_a_reason(
    upstream, reference_v1
):
    """A request that pause(abort) aborts before its first token streams ``[DONE]`` with HTTP
    200 and no finish_reason (vLLM 0.30 and 0.32, default scheduler): a client cannot tell
    it from a truncated stream. Not ours; clients should treat it as aborted."""
    upstream.pause("keep")  # queued: it cannot produce a token before the abort
    stream = StreamingCompletion(reference_v1.url, PROBE, 16, ignore_eos=True)
    stream.start()
    time.sleep(0.5)
    upstream.pause("abort")
    stream.join(60)
    upstream.resume()
    assert stream.status_code == 200 and stream.error is None
    assert stream.num_tokens == 0 and stream.finish_reason is None


CONTROL_FUZZ = {  # case -> (route, query parameters)
    "sleep_level_text": ("/sleep", {"level": "deep"}),
    "sleep_level_float": ("/sleep", {"level": "1.5"}),
    "sleep_level_negative": ("/sleep", {"level": -1}),
    "sleep_level_huge": ("/sleep", {"level": 2**40}),
    "sleep_mode_unknown": ("/sleep", {"level": 1, "mode": "nap"}),
    "wake_up_tag_unknown": ("/wake_up", {"tags": "brains"}),  # upstream: 200, ignored
    "wake_up_tag_empty": ("/wake_up", {"tags": ""}),  # upstream: 200, ignored
    "pause_mode_unknown": ("/pause", {"mode": "nap"}),
    "pause_clear_cache_text": ("/pause", {"mode": "keep", "clear_cache": "maybe"}),
}


@pytest.mark.parametrize("asleep", [False, True], ids=["awake", "asleep"])
@pytest.mark.parametrize("case", list(CONTROL_FUZZ))
def test_malformed_control_calls_are_refused_and_change_nothing(
    server, ctl, baseline, case, asleep
):
    """Every malformed parameter of the control routes our scheduler and worker serve, awake
    and asleep (level 1): refused with a 4xx/5xx, and the engine is in the state it was in
    (the fixture then checks the tokens). Unknown /wake_up tags never reach a plugin: vLLM's
    executor (Executor.wake_up, v1/executor/abstract.py) logs "Tag ... is not in sleeping
    tags" and returns, so the route answers 200 and nothing changes."""
    if asleep:
        ctl.sleep(level=1)
    route, params = CONTROL_FUZZ[case]
    r = requests.post(server.url + route, params=params, timeout=60)
    if route == "/wake_up":
        assert r.status_code == 200, f"{case}: {r.status_code} {r.text[:300]}"
    else:
        assert r.status_code >= 400, f"{case}: {r.status_code} {r.text[:300]}"
    assert ctl.is_sleeping() is asleep
    assert ctl.is_paused() is asleep
