"""The seed's async-RL e2e with the HCCL engine on CPU (gloo), plus its error paths.

A server starts on v1 weights with ``--weight-transfer-config '{"backend": "hccl"}'`` and the
plugin scheduler; a separate trainer process holds v2 (same shape, other seed). Requests stream;
``/pause?mode=keep`` -> ``send_weights()`` -> ``/resume``; every request must finish with all its
tokens, and greedy generation on a fresh v2 server from prompt + tokens-before-pause must
reproduce the tokens after the pause exactly.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import requests

from vllm_ascend_rl.client import EngineControlClient
from vllm_ascend_rl.testing import (
    PLUGIN_SCHEDULER,
    VLLMServer,
    build_model_pair,
    engine_args,
    free_port,
    greedy_token_ids,
)
from vllm_ascend_rl.testing.rl_step import check_continuations, swap_mid_generation
from vllm_ascend_rl.testing.trainer import TrainerError, TrainerProcess

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

PROBE = "Weights under test:"
SMALL_BUCKET = 64 << 10  # smaller than the largest tensor (embed/lm_head: 512 x 128 bf16)


@pytest.fixture(scope="module")
def models():
    return build_model_pair()


@pytest.fixture(scope="module")
def servers(models, tmp_path_factory):
    v1, v2 = models
    logs = tmp_path_factory.mktemp("hccl-logs")
    engine = VLLMServer(
        v1,
        log_path=logs / "engine.log",
        extra_args=[
            *engine_args(),
            "--scheduler-cls",
            PLUGIN_SCHEDULER,
            "--enable-scale-out",  # /inference/v1/generate reports weight-version spans
            "--weight-transfer-config",
            '{"backend": "hccl"}',
        ],
    )
    reference = VLLMServer(v2, log_path=logs / "reference-v2.log", extra_args=engine_args())
    try:
        engine.start(wait=False)
        reference.start(wait=False)
        engine.wait_healthy()
        reference.wait_healthy()
        yield engine, reference
    finally:
        engine.stop()
        reference.stop()


@pytest.fixture(scope="module")
def engine(servers):
    return servers[0]


@pytest.fixture(scope="module")
def reference(servers):
    return servers[1]


@pytest.fixture(scope="module")
def v1_probe(engine):
    """Greedy output of the engine on its start-up (v1) weights."""
    return greedy_token_ids(engine.url, PROBE, 24)


@pytest.fixture(scope="module")
def trainer(models, tmp_path_factory):
    log = tmp_path_factory.mktemp("trainer") / "trainer.log"
    with TrainerProcess(models[1], log_path=log) as t:
        yield t


def init(trainer, engine, **kw):
    kw.setdefault("timeout_s", 30)
    kw.setdefault("world_size", 2)
    trainer.init("hccl", engine.url, master_address="127.0.0.1", master_port=free_port(), **kw)


@pytest.fixture
def on_v1(engine, trainer, models, v1_probe):
    """Put the engine back on v1 weights (by a sync) and leave the trainer holding v2."""
    ctl = EngineControlClient(engine.url)
    ctl.resume()
    init(trainer, engine)
    trainer.load(models[0])
    trainer.send(weight_version="v1")
    trainer.load(models[1])
    assert greedy_token_ids(engine.url, PROBE, 24) == v1_probe
    yield
    ctl.resume()


def assert_alive_and_intact(engine, v1_probe):
    assert engine.is_healthy(), "server died"
    assert greedy_token_ids(engine.url, PROBE, 24) == v1_probe, "weights changed"


@pytest.mark.parametrize(
    "wire",
    [
        {"packed": True},
        {"packed": False},
        {"packed": True, "packed_buffer_size_bytes": SMALL_BUCKET, "packed_num_buffers": 3},
    ],
    ids=["packed", "unpacked", "small_bucket"],
)
def test_weight_swap_continues_on_new_weights(engine, reference, trainer, on_v1, wire):
    init(trainer, engine, **wire)
    out = swap_mid_generation(engine.url, lambda: trainer.send(weight_version="v2"))
    assert not out.problems, out.problems
    assert all(k > 0 for k in out.split), out.split
    if wire.get("packed_buffer_size_bytes") == SMALL_BUCKET:
        assert out.sync_result["num_buckets"] > 2
    assert out.sync_result["bytes"] > 0
    assert check_continuations(reference.url, out) == [True] * len(out.streams)
    assert requests.get(engine.url + "/weight_info", timeout=10).json() == {"weight_version": "v2"}


def test_weight_version_tags_the_tokens_it_produced(engine, trainer, on_v1):
    """The version given to send_weights() reaches finish_weight_update: vLLM's per-output
    weight-version spans split one request's tokens into those of v1 and those of v2."""
    init(trainer, engine)
    tokens: list[int] = []
    final: dict = {}
    started = threading.Event()

    def generate() -> None:
        body = {
            "model": "tiny",
            "token_ids": [11, 12, 13, 14],
            "stream": True,
            "sampling_params": {"max_tokens": 300, "temperature": 0, "ignore_eos": True},
        }
        with requests.post(
            engine.url + "/inference/v1/generate", json=body, stream=True, timeout=300
        ) as r:
            assert r.status_code == 200, r.text
            for line in r.iter_lines():
                if line.startswith(b"data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    tokens.extend(choice.get("token_ids") or [])
                    if len(tokens) >= 8:
                        started.set()
                    final.update(choice)

    errors: list[BaseException] = []

    def run() -> None:
        try:
            generate()
        except BaseException as e:
            errors.append(e)
        finally:
            started.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(120) and not errors, errors
    ctl = EngineControlClient(engine.url)
    ctl.pause("keep")
    split = _settled(tokens)
    trainer.send(weight_version="v2")
    ctl.resume()
    thread.join(300)
    assert len(tokens) == 300 and 0 < split < 300
    assert final["weight_versions"] == [
        {"version": "v1", "start": 0, "end": split},
        {"version": "v2", "start": split, "end": 300},
    ]
    assert requests.get(engine.url + "/weight_info", timeout=10).json() == {"weight_version": "v2"}


def _settled(tokens: list, quiet_s: float = 0.3) -> int:
    last, since = len(tokens), time.monotonic()
    while time.monotonic() - since < quiet_s:
        time.sleep(0.02)
        if len(tokens) != last:
            last, since = len(tokens), time.monotonic()
    return last


def test_clear_cache_false_continues_on_stale_kv(engine, reference, trainer, on_v1):
    """Documented fact: pause(keep, clear_cache=false) keeps the v1 KV cache, so after a swap
    the continuation attends to stale keys/values and differs from a v2 recompute."""
    init(trainer, engine)
    out = swap_mid_generation(
        engine.url, lambda: trainer.send(weight_version="v2"), clear_cache=False
    )
    assert not out.problems, out.problems
    matches = check_continuations(reference.url, out)
    assert not any(matches), f"expected every continuation to differ (stale KV): {matches}"


@pytest.mark.parametrize(
    "fault, message",
    [
        (
            {"rename": "model.layers.1.mlp.up_proj.weight"},
            "unknown parameter 'model.layers.1.mlp.up_proj.weight_unknown'",
        ),
        (
            {"grow": "model.layers.0.mlp.gate_proj.weight"},
            "'model.layers.0.mlp.gate_proj.weight': shape [320, 128]",
        ),
        (
            {"dtype": "float32", "dtype_param": "model.norm.weight"},
            "'model.norm.weight': dtype float32",
        ),
        ({"dtype": "int32", "dtype_param": "lm_head.weight"}, "'lm_head.weight': dtype int32"),
    ],
    ids=["unknown_name", "oversized_shape", "float32", "int32"],
)
def test_bad_metadata_is_refused_and_model_untouched(
    engine, trainer, on_v1, v1_probe, fault, message
):
    init(trainer, engine)
    with pytest.raises(TrainerError, match="refused") as err:
        trainer.send(**fault)
    assert message in str(err.value)
    assert_alive_and_intact(engine, v1_probe)
    trainer.send(weight_version="v2")  # the channel survives a refusal: no re-init needed
    assert greedy_token_ids(engine.url, PROBE, 24) != v1_probe


def test_trainer_dying_mid_broadcast(engine, reference, models, trainer, on_v1, tmp_path):
    timeout_s = 10
    with TrainerProcess(models[1], log_path=tmp_path / "dying.log") as doomed:
        init(doomed, engine, packed_buffer_size_bytes=SMALL_BUCKET, timeout_s=timeout_s)
        t0 = time.monotonic()
        with pytest.raises(TrainerError, match="exited"):
            doomed.send(die_after_tensors=12)
    # The engine's update must fail within timeout_s, with a message, and keep serving.
    deadline = t0 + timeout_s + 30
    while "weight transfer failed" not in engine.log_path.read_text(errors="replace"):
        assert time.monotonic() < deadline, "engine did not report the failed transfer"
        time.sleep(0.5)
    assert engine.is_healthy()
    assert greedy_token_ids(engine.url, PROBE, 8)  # serves (possibly mixed weights)
    init(trainer, engine)  # a new init works afterwards, and a full sync restores v2 exactly
    trainer.send(weight_version="v2")
    assert greedy_token_ids(engine.url, PROBE, 24) == greedy_token_ids(reference.url, PROBE, 24)


def test_stalled_trainer_times_out_on_both_sides(engine, reference, trainer, on_v1):
    timeout_s, stall_s = 5, 9
    init(trainer, engine, packed_buffer_size_bytes=SMALL_BUCKET, timeout_s=timeout_s)
    t0 = time.monotonic()
    with pytest.raises(TrainerError, match=f"no progress within timeout_s={timeout_s}s"):
        trainer.send(stall_after_tensors=12, stall_s=stall_s)  # the engine's message
    assert time.monotonic() - t0 < stall_s + 2 * timeout_s + 10
    assert engine.is_healthy()
    init(trainer, engine)
    trainer.send(weight_version="v2")
    assert greedy_token_ids(engine.url, PROBE, 24) == greedy_token_ids(reference.url, PROBE, 24)


def _post(engine, route, **kw):
    return requests.post(engine.url + route, timeout=120, **kw)


def test_update_without_start(engine, on_v1, v1_probe):
    r = _post(
        engine,
        "/update_weights",
        json={
            "update_info": {
                "names": ["lm_head.weight"],
                "dtype_names": ["bfloat16"],
                "shapes": [[512, 128]],
            }
        },
    )
    assert r.status_code >= 400 and "start_weight_update" in r.text, r.text
    assert_alive_and_intact(engine, v1_probe)


def test_finish_without_start(engine, on_v1, v1_probe):
    r = _post(engine, "/finish_weight_update")
    assert r.status_code >= 400 and "start_weight_update" in r.text, r.text
    assert_alive_and_intact(engine, v1_probe)


def test_start_twice(engine, on_v1, v1_probe):
    assert _post(engine, "/start_weight_update").status_code == 200
    r = _post(engine, "/start_weight_update")
    assert r.status_code >= 400 and "already" in r.text, r.text
    assert _post(engine, "/finish_weight_update").status_code == 200  # nothing loaded
    assert_alive_and_intact(engine, v1_probe)


def test_init_with_unreachable_master(engine, on_v1, v1_probe):
    t0 = time.monotonic()
    r = _post(
        engine,
        "/init_weight_transfer_engine",
        json={
            "init_info": {
                "master_address": "127.0.0.1",
                "master_port": free_port(),
                "world_size": 2,
                "timeout_s": 3,
            }
        },
    )
    assert r.status_code >= 400 and "rendezvous" in r.text, r.text
    assert time.monotonic() - t0 < 60
    assert_alive_and_intact(engine, v1_probe)


def test_init_with_wrong_world_size(engine, trainer, on_v1, v1_probe):
    with pytest.raises(TrainerError, match=r"world_size=3 but the engine .* has 1 worker"):
        init(trainer, engine, world_size=3)
    r = _post(
        engine,
        "/init_weight_transfer_engine",
        json={
            "init_info": {
                "master_address": "127.0.0.1",
                "master_port": free_port(),
                "world_size": 1,
            }
        },
    )
    assert r.status_code >= 400 and "world_size" in r.text, r.text
    assert_alive_and_intact(engine, v1_probe)
