"""The seed's pause/resume e2e matrix against a real vLLM CPU server.

Every test runs three times: with the plugin's ``AsyncRecomputeScheduler`` (``local`` and
``bounce`` recompute modes) and with vLLM's default scheduler, so any divergence of the plugin
from upstream behaviour shows up as a failure (a bounced pause would show as an early finish).
Every test leaves the server resumed.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import requests

from tests.support import (
    PLUGIN_SCHEDULER,
    StreamingCompletion,
    TinyModelSpec,
    VLLMServer,
    build_tiny_model,
    complete,
    engine_args,
)
from tests.support.streams import settled
from vllm_ascend_rl.client import EngineControlClient

pytestmark = [pytest.mark.e2e, pytest.mark.ascend, pytest.mark.timeout(600)]

MODES = ("abort", "wait", "keep")
PROMPT = "The quick brown fox jumps over the lazy dog"
LONG = 1500  # tokens: several seconds of decoding, so a pause lands mid-stream
OBSERVE_S = 1.0  # window in which a paused engine must produce nothing


SCHEDULERS = ("plugin", "plugin-bounce", "default")


def bounce_mode_engine(log_dir: Path) -> list[VLLMServer]:
    args = [*engine_args(), "--enable-prefix-caching", "--enable-prompt-tokens-details"]
    return [
        VLLMServer(
            build_tiny_model(TinyModelSpec(seed=1)),
            extra_args=[*args, "--scheduler-cls", PLUGIN_SCHEDULER],
            log_path=log_dir / "server-plugin-bounce.log",
            additional_config={"ascend_rl": {"recompute_mode": "bounce"}},
        )
    ]


SERVERS = (bounce_mode_engine,)


@pytest.fixture(scope="module")
def servers(server_plan, rl_engines, reference_v1):
    """One server per scheduler, on the same weights: the session's RL engine (``plugin``),
    its vLLM engine (``default``), and one in bounce mode."""
    with server_plan.serving(bounce_mode_engine) as (bounce,):
        yield {
            "plugin": rl_engines("ascend_rl_hccl"),
            "plugin-bounce": bounce,
            "default": reference_v1,
        }


@pytest.fixture(scope="module", params=SCHEDULERS)
def server(request, servers):
    return servers[request.param]


@pytest.fixture
def ctl(server):
    client = EngineControlClient(server.url, timeout_s=120)
    client.resume()
    assert client.is_paused() is False
    yield client
    client.resume()


def post(server: VLLMServer, route: str, **params) -> requests.Response:
    return requests.post(server.url + route, params=params, timeout=120)


def is_paused(server: VLLMServer) -> bool:
    r = requests.get(server.url + "/is_paused", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["is_paused"]


def test_server_runs_the_requested_scheduler(server, request):
    kind = request.node.callspec.params["server"]
    log = server.log_path.read_text(errors="replace")
    uses_plugin = f"Using custom scheduler class {PLUGIN_SCHEDULER}" in log
    assert uses_plugin == kind.startswith("plugin")
    assert ("recompute_mode=bounce" in log) == (kind == "plugin-bounce")


def test_pause_resume_state_is_idempotent_across_cycles(server, ctl):
    assert is_paused(server) is False
    for _ in range(2):
        assert post(server, "/resume").status_code == 200
        assert is_paused(server) is False
    for _cycle in range(2):
        for mode in MODES:
            for _ in range(2):
                r = post(server, "/pause", mode=mode)
                assert r.status_code == 200, r.text
                assert r.json() == {"status": "paused"}
                assert is_paused(server) is True
                assert ctl.is_sleeping() is True  # vLLM counts a paused scheduler as asleep
            for _ in range(2):
                r = post(server, "/resume")
                assert r.status_code == 200, r.text
                assert is_paused(server) is False
                assert ctl.is_sleeping() is False


@pytest.mark.parametrize("start_paused", [False, True], ids=["from_unpaused", "from_paused"])
def test_invalid_pause_mode_preserves_state(server, ctl, start_paused):
    if start_paused:
        ctl.pause("keep")
    before = is_paused(server)
    assert before is start_paused
    r = post(server, "/pause", mode="invalid")
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    error = r.json()["error"]
    where = error.get("param") or error.get("message", "")
    assert "query" in where and "mode" in where, error
    assert is_paused(server) is before
    ctl.resume()
    out = complete(server.url, PROMPT, 4)  # still serving
    assert out["choices"][0]["finish_reason"] == "length"


def _start_inflight(
    server: VLLMServer, max_tokens: int, min_tokens: int = 1
) -> StreamingCompletion:
    stream = StreamingCompletion(server.url, PROMPT, max_tokens)
    stream.start()
    assert stream.first_token.wait(120), "in-flight request produced no token"
    assert stream.error is None, stream.error
    assert stream.wait_for_tokens(min_tokens, timeout_s=60)
    return stream


def _assert_pending(stream: StreamingCompletion) -> None:
    """A request sent while paused is accepted but gets no token."""
    stream.start()
    time.sleep(OBSERVE_S)
    assert stream.is_alive(), f"request sent while paused ended: {stream.error}"
    assert stream.num_tokens == 0


def _pause_mid_stream(server, ctl, mode: str, max_tokens: int):
    """Start a stream and pause while it is still decoding; retry if it finished first."""
    for _ in range(3):
        inflight = _start_inflight(server, max_tokens)
        before = inflight.num_tokens
        r = post(server, "/pause", mode=mode)
        assert r.status_code == 200, r.text
        assert is_paused(server) is True
        if mode == "wait":
            if before < max_tokens:
                return inflight, before
        else:
            # abort: the stream ends; keep: it freezes
            settled(lambda s=inflight: s.num_tokens, server.url)
            if inflight.finish_reason != "length":
                return inflight, before
        ctl.resume()  # the stream finished before the pause landed: try again
        inflight.join(60)
    pytest.fail("could not pause mid-stream in 3 attempts")


@pytest.mark.parametrize("mode", MODES)
def test_pause_mode_request_lifecycle(server, ctl, mode):
    max_tokens = 300 if mode == "wait" else LONG
    inflight, before_pause = _pause_mid_stream(server, ctl, mode, max_tokens)

    if mode == "abort":
        inflight.join(30)
        assert not inflight.is_alive()
        assert inflight.finish_reason == "abort"
        aborted_at = inflight.num_tokens
        assert aborted_at < max_tokens
    elif mode == "wait":
        # /pause returned only after the in-flight request ran to completion.
        assert before_pause < max_tokens, "pause landed after the stream had ended"
        inflight.join(10)
        assert not inflight.is_alive()
        assert inflight.finish_reason == "length"
        assert inflight.num_tokens == max_tokens
    else:  # keep: frozen, not finished
        frozen = settled(lambda: inflight.num_tokens, server.url)
        assert inflight.is_alive() and frozen < max_tokens
        time.sleep(OBSERVE_S)
        assert inflight.num_tokens == frozen, "tokens were generated while paused"

    pending = StreamingCompletion(server.url, "A request sent while paused", 32)
    _assert_pending(pending)
    assert is_paused(server) is True

    ctl.resume()
    pending.join(120)
    assert pending.ok, (pending.status_code, pending.error)
    assert pending.finish_reason == "length" and pending.num_tokens == 32

    if mode == "abort":
        time.sleep(OBSERVE_S)
        assert inflight.num_tokens == aborted_at, "an aborted request was resumed"
    elif mode == "keep":
        inflight.join(300)
        assert inflight.ok, inflight.error
        assert inflight.finish_reason == "length"
        assert inflight.num_tokens == max_tokens


def _normalized(out: dict) -> dict:
    choice, usage = out["choices"][0], out["usage"]
    return {
        "text": choice["text"],
        "finish_reason": choice["finish_reason"],
        "token_ids": choice["token_ids"],
        "prompt_tokens": usage["prompt_tokens"],
        "completion_tokens": usage["completion_tokens"],
    }


def _cached_tokens(out: dict) -> int:
    return (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def test_clear_cache_preserves_output_and_controls_prefix_cache(server, ctl):
    # Several KV blocks long (the CPU default block is 128 tokens), greedy.
    prompt = " ".join(f"{w} number {i}," for i, w in enumerate(["alpha", "beta", "gamma"] * 30))

    def generate() -> dict:
        return complete(server.url, prompt, 24, ignore_eos=False)

    ctl.pause("abort", clear_cache=True)
    ctl.resume()
    r0 = generate()
    assert r0["usage"]["prompt_tokens"] > 256
    r1 = generate()
    assert _cached_tokens(r1) > 0, "prefix cache did not warm up"
    assert _normalized(r1) == _normalized(r0)

    ctl.pause("abort", clear_cache=False)
    ctl.resume()
    r2 = generate()
    assert _normalized(r2) == _normalized(r0)
    assert _cached_tokens(r2) > 0, "clear_cache=false dropped the prefix cache"

    ctl.pause("abort", clear_cache=True)
    ctl.resume()
    r3 = generate()
    assert _normalized(r3) == _normalized(r0)
    assert _cached_tokens(r3) == 0, "clear_cache=true kept the prefix cache"
