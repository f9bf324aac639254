"""``recompute_mode=bounce`` and the router, against real vLLM CPU servers.

One engine has a tiny KV cache (``--num-gpu-blocks-override``) and bounces; a second,
unconstrained server with vLLM's default scheduler is the greedy reference. Requests are
queued behind a pause and admitted together, so the cache is overcommitted for certain.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
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
    free_port,
    greedy_token_ids,
)
from tests.support.addresses import assert_addresses_kept
from tests.support.metrics import added, scrape
from tests.support.router import running_router
from vllm_ascend_rl.client import EngineControlClient

pytestmark = [pytest.mark.e2e, pytest.mark.ascend, pytest.mark.timeout(900)]

BOUNCE = {"ascend_rl": {"recompute_mode": "bounce"}}
BLOCKS = 24  # x 32 tokens; one is the null block
MAX_TOKENS = 300
PROMPTS = [f"Request {i}: tell me about the number {i * 37 % 101} and why" for i in range(10)]


def bounce_engine_args() -> list[str]:
    return [
        *engine_args(),
        "--scheduler-cls",
        PLUGIN_SCHEDULER,
        "--block-size",
        "32",
        "--num-gpu-blocks-override",
        str(BLOCKS),
        "--max-num-seqs",
        "8",
    ]


def bounce_engine(log_dir: Path) -> list[VLLMServer]:
    return [
        VLLMServer(
            build_tiny_model(TinyModelSpec(seed=1)),
            max_model_len=512,
            extra_args=bounce_engine_args(),
            additional_config=BOUNCE,
            log_path=log_dir / "bounce.log",
        )
    ]


SERVERS = (bounce_engine,)


@pytest.fixture(scope="module")
def servers(server_plan, reference_v1):
    """The bounce engine, and vLLM's own engine on the same weights: the reference, and where
    the router sends a bounced request."""
    with server_plan.serving(bounce_engine) as (engine,):
        yield engine, reference_v1


@pytest.fixture(scope="module")
def references(servers) -> dict[str, list[int]]:
    _, reference = servers
    return {p: greedy_token_ids(reference.url, p, MAX_TOKENS) for p in PROMPTS}


@pytest.fixture(scope="module")
def router(servers):
    engine, reference = servers
    with running_router([engine.url, reference.url]) as url:
        yield url


def admitted_together(engines: list[VLLMServer], send) -> None:
    """Queue every request behind a pause, then resume: they are admitted in one step."""
    ctl = EngineControlClient([e.url for e in engines], timeout_s=120)
    ctl.pause("keep")
    try:
        send()
        time.sleep(1.0)  # the requests reach the engine's waiting queue
    finally:
        ctl.resume()


def test_kv_starved_requests_bounce_with_the_tokens_they_generated(servers, references):
    engine, _ = servers
    with ThreadPoolExecutor(8) as pool:
        futures = []
        admitted_together(
            [engine],
            lambda: futures.extend(
                pool.submit(complete, engine.url, p, MAX_TOKENS, timeout_s=600) for p in PROMPTS[:8]
            ),
        )
        results = [f.result(600) for f in futures]
    bounced = 0
    for prompt, res in zip(PROMPTS, results, strict=False):
        assert isinstance(res, dict), res
        choice = res["choices"][0]
        tokens = choice["token_ids"]
        if choice["finish_reason"] != "length":  # a bounce: never mistakable for an end
            assert (choice["finish_reason"], choice["stop_reason"]) == ("abort", "recomputed")
            assert 0 < len(tokens) < MAX_TOKENS
            bounced += 1
        else:
            assert choice["finish_reason"] == "length" and len(tokens) == MAX_TOKENS
        assert tokens == references[prompt][: len(tokens)], "a bounce lost or changed tokens"
    print(f"\n{bounced} of 8 requests bounced")
    assert bounced >= 1
    log = engine.log_path.read_text(errors="replace")
    assert "bounced" in log and "KV cache full" in log
    assert engine.is_healthy()
    assert_addresses_kept(engine.url, "the bounces")


def test_through_the_router_every_completion_equals_the_greedy_reference(
    servers, references, router
):
    before = requests.get(router + "/router/stats", timeout=10).json()["resends"]
    streams = [StreamingCompletion(router, p, MAX_TOKENS, timeout_s=600) for p in PROMPTS[::2]]
    with ThreadPoolExecutor(len(PROMPTS[1::2])) as pool:
        futures = []

        def send():
            for s in streams:
                s.start()
            futures.extend(
                pool.submit(complete, router, p, MAX_TOKENS, timeout_s=600) for p in PROMPTS[1::2]
            )

        # Both replicas paused: the router sees every request in flight and deals them out
        # evenly. With the reference alone running, it finished its share in about a second and
        # drew most of the rest, too few reached the engine to exhaust its KV cache (once in CI).
        admitted_together(servers, send)
        results = [f.result(600) for f in futures]
    for s in streams:
        s.join(600)
    for prompt, res in zip(PROMPTS[1::2], results, strict=True):
        assert isinstance(res, dict), res
        choice = res["choices"][0]
        assert choice["finish_reason"] == "length", choice
        assert choice["token_ids"] == references[prompt]
        assert res["usage"]["completion_tokens"] == MAX_TOKENS
        assert res["usage"]["prompt_tokens"] == len(choice["prompt_token_ids"])
    for prompt, s in zip(PROMPTS[::2], streams, strict=True):
        assert s.ok, s.error
        assert s.finish_reason == "length" and s.stop_reason is None
        assert s.token_ids == references[prompt]
        assert s.usage["completion_tokens"] == MAX_TOKENS
    resends = requests.get(router + "/router/stats", timeout=10).json()["resends"] - before
    print(f"\nthe router resent {resends} bounced completions")
    assert resends >= 1
    stats = requests.get(router + "/router/stats", timeout=10).json()
    counted = scrape(router, "/router/metrics")
    assert added({}, counted, "router_resends") == stats["resends"]
    for url, n in stats["requests"].items():
        assert added({}, counted, "router_requests", engine=url) == n


def test_router_refuses_what_it_cannot_stitch(router):
    r = requests.post(
        router + "/v1/completions",
        json={"model": "tiny", "prompt": ["a", "b"], "max_tokens": 4},
        timeout=30,
    )
    assert r.status_code == 400 and "one prompt" in r.json()["error"]["message"]
    r = requests.post(
        router + "/v1/completions",
        json={"model": "tiny", "prompt": "a", "max_tokens": 4, "n": 2},
        timeout=30,
    )
    assert r.status_code == 400 and "n=1" in r.json()["error"]["message"]
    r = requests.get(router + "/v1/models", timeout=30)  # other paths are forwarded
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny"


def test_router_reports_a_dead_engine_clearly():
    with running_router([f"http://127.0.0.1:{free_port()}"]) as url:  # nothing listens there
        body = {"model": "tiny", "prompt": "a", "max_tokens": 4}
        r = requests.post(url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 502 and "failed" in r.json()["error"]["message"]
        stream = StreamingCompletion(url, "a", 4, timeout_s=30)
        stream.run()  # in this thread
        assert stream.error and "failed" in stream.error and stream.finish_reason is None
        assert requests.get(url + "/v1/models", timeout=30).status_code == 502
        assert requests.get(url + "/router/stats", timeout=30).ok  # the router lives on
