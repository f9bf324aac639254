"""External load balancing: two independent servers behind one EngineControlClient and the router.

With external load balancing every engine must be paused on its own (the seed's DP rule), so
control calls fan out, all or nothing: when one engine fails to pause or sleep, the ones that
did are resumed or woken and the error names the failed engine. One trainer syncs both engines,
one HCCL group per engine (world size 2 each): an engine that dies mid-sync then fails only its
own sync, and the other engine keeps its weights. The engines are also the router's replicas.
The reference for the synced weights is vLLM's own loader (``reload_weights`` from disk).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import requests

from tests.e2e.weight_sync_cases import PROBE, init_trainer
from tests.support import (
    StreamingCompletion,
    VLLMServer,
    build_model_pair,
    free_port,
    greedy_token_ids,
    rl_engine_args,
)
from tests.support.dead_engine import kill_mid_sync
from tests.support.profile import trainer_env
from tests.support.rl_step import (
    check_continuations,
    pause_each_mid_generation,
    swap_mid_generation,
)
from tests.support.router import running_router
from tests.support.streams import settled
from tests.support.trainer import TrainerProcess
from vllm_ascend_rl.client import EngineControlClient, EnginesDisagree, FanOutError

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

TIMEOUT_S = 15  # the trainer's timeout_s
OBSERVE_S = 1.0  # window in which a paused engine must produce nothing
MAX_TOKENS = 1000


@pytest.fixture(scope="module")
def models():
    return build_model_pair()


def two_engines(log_dir: Path) -> list[VLLMServer]:
    return [
        VLLMServer(
            build_model_pair()[0],
            log_path=log_dir / f"engine-{name}.log",
            extra_args=rl_engine_args("ascend_rl_hccl", sleepable=True),
        )
        for name in ("a", "b")
    ]


SERVERS = (two_engines,)


@pytest.fixture(scope="module")
def engines(server_plan) -> Iterator[tuple[VLLMServer, VLLMServer]]:
    with server_plan.serving(two_engines) as (a, b):
        yield a, b


@pytest.fixture(scope="module")
def v1_tokens(engines) -> list[int]:
    a, b = engines
    tokens = greedy_token_ids(a.url, PROBE, 16)
    assert greedy_token_ids(b.url, PROBE, 16) == tokens
    return tokens


@pytest.fixture(scope="module")
def router(engines):
    with running_router([e.url for e in engines]) as url:
        yield url


@pytest.fixture
def ctl(engines) -> Iterator[EngineControlClient]:
    client = EngineControlClient([e.url for e in engines], timeout_s=120)
    yield client
    for e in engines:  # leave every engine awake and resumed, one by one
        one = EngineControlClient(e.url, timeout_s=120)
        if one.is_sleeping():
            one.wake_up()
        one.resume()


def is_paused(engine: VLLMServer) -> bool:
    return EngineControlClient(engine.url).is_paused()


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


def streams_on(engines, max_tokens: int = MAX_TOKENS, min_tokens: int = 4) -> list:
    """Two streams per engine, all mid-way and running: admitted behind a pause, each engine
    paused again by its own probe once its streams have ``min_tokens`` (a short run each, so
    none is near ``max_tokens``), then one resume. A short stream first warms each server's
    streaming path up. A probe that overshoots (an API server can answer ``/resume`` seconds
    late while its engine decodes) → finish the round and start another."""
    for e in engines:
        warm = StreamingCompletion(e.url, "warm up", 4)
        warm.run()
    urls = [e.url for e in engines]
    both = EngineControlClient(urls, timeout_s=60)
    for _round in range(3):
        streams = [
            StreamingCompletion(urls[i % len(urls)], f"Stream {i}:", max_tokens) for i in range(4)
        ]
        both.pause("keep")
        for s in streams:
            s.start()
        time.sleep(0.5)
        split, _ = pause_each_mid_generation(urls, streams, min_tokens, max_tokens)
        both.resume()
        if max(split) < max_tokens // 2:
            return streams
        finish(streams, max_tokens)
    raise AssertionError(f"no round left every stream mid-way: {split}")


def finish(streams: list[StreamingCompletion], max_tokens: int = MAX_TOKENS) -> None:
    for s in streams:
        s.join(300)
        assert s.ok, s.error
        assert s.finish_reason == "length" and s.num_tokens == max_tokens


def test_one_pause_stops_every_engine_and_one_resume_restarts_them(engines, ctl, v1_tokens):
    """Streams on both engines, one pause(keep) fanned out while every stream is mid-way, one
    second paused (nothing may arrive), one resume: every stream finishes with all its tokens."""
    streams = streams_on(engines)  # each has more than MAX_TOKENS // 2 tokens to go
    t0 = time.perf_counter()
    ctl.pause("keep")
    pause_ms = (time.perf_counter() - t0) * 1e3
    assert all(is_paused(e) for e in engines)
    frozen = settled(lambda: [s.num_tokens for s in streams], [e.url for e in engines])
    assert all(0 < n < MAX_TOKENS for n in frozen), frozen
    time.sleep(OBSERVE_S)
    assert [s.num_tokens for s in streams] == frozen, "tokens arrived while paused"
    t1 = time.perf_counter()
    ctl.resume()
    finish(streams)
    rest_s = time.perf_counter() - t1
    assert {s.url.removesuffix("/v1/completions") for s in streams} == {e.url for e in engines}
    print(
        f"\npause(keep) fanned out to 2 engines mid-generation: {pause_ms:.0f} ms, "
        f"at {frozen} of {MAX_TOKENS} tokens; the rest took {rest_s:.1f} s"
    )


def test_an_is_paused_disagreement_is_reported(engines, ctl, router):
    a, b = engines
    EngineControlClient(a.url).pause("keep")
    with pytest.raises(EnginesDisagree) as e:
        ctl.is_paused()
    assert e.value.values == {a.url: True, b.url: False}
    assert a.url in str(e.value) and b.url in str(e.value)
    r = requests.get(router + "/is_paused", timeout=30)
    assert r.status_code == 409, r.text
    assert "disagree" in r.text and a.url in r.text


def test_engine_down_before_pause_resumes_the_engines_that_paused(engines, ctl, v1_tokens):
    a, b = engines
    dead = dead_url()
    streams = streams_on(engines)
    with pytest.raises(FanOutError) as e:
        EngineControlClient([a.url, b.url, dead], timeout_s=30).pause("keep")
    assert set(e.value.failures) == {dead} and e.value.failures[dead].status is None
    assert e.value.undone == {a.url: None, b.url: None}, e.value.undone
    assert dead in str(e.value) and "/resume sent" in str(e.value)
    assert not any(is_paused(x) for x in engines)
    finish(streams)  # generation went on
    with pytest.raises(FanOutError, match="/wake_up sent"):
        EngineControlClient([a.url, dead], timeout_s=30).sleep(1)
    assert EngineControlClient(a.url).is_sleeping() is False
    assert greedy_token_ids(a.url, PROBE, 16) == v1_tokens


@contextmanager
def hung(engine: VLLMServer) -> Iterator[None]:
    """The engine's API server stops answering (SIGSTOP), then comes back. A pause it
    accepted while hung lands late: settling that engine is its caller's business, done here."""
    os.kill(engine.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(engine.proc.pid, signal.SIGCONT)
    time.sleep(1)
    EngineControlClient(engine.url).resume()
    assert not is_paused(engine)


def test_engine_hung_during_pause_resumes_the_engines_that_paused(engines, ctl, v1_tokens):
    a, b = engines
    with hung(b), pytest.raises(FanOutError) as e:
        EngineControlClient([a.url, b.url], timeout_s=3).pause("keep")
    assert set(e.value.failures) == {b.url}, e.value
    assert "timed out" in str(e.value.failures[b.url]).lower()
    assert e.value.undone == {a.url: None}
    assert not is_paused(a)
    assert greedy_token_ids(b.url, PROBE, 16) == v1_tokens


def test_router_fans_control_routes_out_and_refuses_per_engine_ones(
    engines, ctl, router, v1_tokens
):
    a, b = engines

    def post(route: str, **params) -> requests.Response:
        return requests.post(router + route, params=params, timeout=120)

    assert post("/pause", mode="keep").status_code == 200
    assert is_paused(a) and is_paused(b)
    assert requests.get(router + "/is_paused", timeout=30).json() == {"is_paused": True}
    assert post("/resume").status_code == 200
    assert not is_paused(a) and not is_paused(b)
    bad = post("/pause", mode="sideways")  # both refuse: their own 4xx, nothing paused
    assert 400 <= bad.status_code < 500, bad.text
    assert not is_paused(a) and not is_paused(b)
    assert post("/sleep", level=1).status_code == 200
    assert all(EngineControlClient(e.url).is_sleeping() for e in engines)
    assert post("/wake_up").status_code == 200
    assert not any(EngineControlClient(e.url).is_sleeping() for e in engines)
    for route in (
        "/collective_rpc",
        "/init_weight_transfer_engine",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/release_kv_cache_memory",
    ):
        r = requests.post(router + route, json={"method": "memory_in_use"}, timeout=30)
        assert r.status_code == 403, (route, r.text)
        assert "does not forward" in r.json()["error"]["message"]
    for engine in engines:  # nothing reached an engine
        assert greedy_token_ids(engine.url, PROBE, 16) == v1_tokens
    assert requests.get(router + "/v1/models", timeout=30).status_code == 200


def test_router_with_an_engine_down_or_hung_pauses_none(engines, ctl):
    a, b = engines
    with running_router([a.url, dead_url()]) as url:
        r = requests.post(url + "/pause", params={"mode": "keep"}, timeout=60)
        assert r.status_code == 502 and "unreachable" in r.text, r.text
        assert not is_paused(a)
    with hung(b), running_router([a.url, b.url], timeout_s=3) as url:
        r = requests.post(url + "/pause", params={"mode": "keep"}, timeout=60)
        assert r.status_code == 502 and b.url in r.text, r.text
        assert not is_paused(a)


@pytest.fixture(scope="module")
def trainer(engines, models, tmp_path_factory) -> Iterator[TrainerProcess]:
    """One trainer (holding v2) with one HCCL connection per engine."""
    log = tmp_path_factory.mktemp("external-lb-trainer") / "trainer.log"
    env = trainer_env([*engines[0].chips, *engines[1].chips], colocated=False)
    with TrainerProcess(models[1], log_path=log, env=env) as t:
        for engine in engines:
            init_trainer("ascend_rl_hccl", t, engine, timeout_s=TIMEOUT_S)
        yield t


def test_one_trainer_syncs_both_engines_mid_generation(engines, ctl, trainer, models):
    a, b = engines
    times: dict[str, float] = {}

    def sync_both() -> None:
        for engine in engines:
            times[engine.url] = trainer.send(weight_version="v2", url=engine.url)["seconds"]

    out = swap_mid_generation([a.url, b.url], sync_both)
    assert not out.problems, out.problems
    assert all(k > 0 for k in out.split), out.split
    v2_tokens = greedy_token_ids(a.url, PROBE, 16)
    assert greedy_token_ids(b.url, PROBE, 16) == v2_tokens
    EngineControlClient(a.url).reload_weights(str(models[1]))  # vLLM's own loader: reference
    assert greedy_token_ids(a.url, PROBE, 16) == v2_tokens
    assert check_continuations(a.url, out) == [True] * len(out.streams)
    print(
        f"\n2 engines: pause {out.pause_ms:.0f} ms, sync {out.sync_ms:.0f} ms "
        f"(per engine {', '.join(f'{s * 1e3:.0f} ms' for s in times.values())}), "
        f"resume {out.resume_ms:.0f} ms"
    )


def test_an_engine_killed_mid_sync_fails_only_its_sync(engines, trainer, models, v1_tokens):
    """Last in the module: engine a does not come back."""
    a, b = engines
    v2_tokens = greedy_token_ids(b.url, PROBE, 16)
    assert v2_tokens != v1_tokens
    trainer.load(models[0])  # the trainer's next "step" is v1 again
    message, elapsed = kill_mid_sync(trainer, a, TIMEOUT_S, url=a.url)
    print(f"\nthe sync to the killed engine failed {elapsed:.1f} s after the kill: {message}")
    assert greedy_token_ids(b.url, PROBE, 16) == v2_tokens  # untouched, intact
    trainer.send(weight_version="v1", url=b.url)  # the other connection still works
    assert greedy_token_ids(b.url, PROBE, 16) == v1_tokens
