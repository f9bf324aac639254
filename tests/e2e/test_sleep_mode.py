"""Sleep mode over HTTP: ``/sleep?level=1|2``, ``/wake_up?tags=...``, ``/is_sleeping``, with the
device's sleepable worker (CPU: ``SleepableCPUWorker``, KV cache in host virtual memory from the
sleep allocator; NPU: ``SleepableNPUWorker``). Memory figures are what the workers' processes
hold on the device (on CPU: their resident set), read through ``/collective_rpc``. The server
runs in vLLM's default compile mode (ACL graphs on Ascend), and after every test no tensor has
moved (the address ledger)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import requests

from tests.support import (
    StreamingCompletion,
    TinyModelSpec,
    VLLMServer,
    build_tiny_model,
    greedy_token_ids,
)
from tests.support.addresses import assert_addresses_kept
from tests.support.metrics import added, scrape
from tests.support.profile import trainer_env
from tests.support.sleep_servers import leave_awake, sleepable_server
from tests.support.tiny_model import parameter_shapes
from tests.support.trainer import TrainerProcess
from tests.support.vllm_features import has_route, sleep_route_validates_level
from vllm_ascend_rl.client import EngineControlClient, EngineControlError

pytestmark = [pytest.mark.e2e, pytest.mark.ascend, pytest.mark.timeout(900)]

SPEC = TinyModelSpec(
    seed=1, num_layers=8, hidden_size=1024, num_heads=16, num_kv_heads=16, intermediate_size=2816
)  # ~210 MB of bf16 weights
KV_GIB = 1
PROBE = "Sleep and wake:"


@pytest.fixture(scope="module")
def model():
    return build_tiny_model(SPEC)


def sleep_engine(log_dir: Path) -> list[VLLMServer]:
    transfer = ["--weight-transfer-config", '{"backend": "ascend_rl_npu_ipc"}']
    faults = ["--worker-extension-cls", "tests.support.sleep_faults.SleepFaults"]
    model = build_tiny_model(SPEC)
    return [
        sleepable_server(
            model,
            log_dir / "server.log",
            extra_args=[*transfer, *faults],
            kv_cache_gib=KV_GIB,
            graphs=True,
        )
    ]


SERVERS = (sleep_engine,)


@pytest.fixture(scope="module")
def server(server_plan):
    with server_plan.serving(sleep_engine) as (srv,):
        yield srv


@pytest.fixture(scope="module")
def baseline(server):
    return greedy_token_ids(server.url, PROBE, 24)


@pytest.fixture
def ctl(server, model, request):
    """The server's control client; after the test, the engine awake and every tensor where
    it started (a sleep, wake, reload or failure that moved one fails the test's teardown)."""
    client = EngineControlClient(server.url, timeout_s=300)
    yield client
    leave_awake(client, model)
    assert_addresses_kept(server.url, request.node.name)


def rss(server: VLLMServer, field: str = "bytes") -> int:
    """Device memory held by the server's workers (on CPU: their resident set)."""
    workers = EngineControlClient(server.url).collective_rpc("memory_in_use")[0]
    return sum(w[field] for w in workers)


def pooled(server: VLLMServer) -> int:
    """Physical memory the workers' sleep allocators hold (mapped, touched or not)."""
    return rss(server, "sleep_pool_bytes")


def level2_frees(server: VLLMServer, ctl: EngineControlClient) -> int:
    """Sleep at level 2 from awake; what it freed: the KV cache and the weights, nothing left
    for a sleep to release. (A level-1 cycle first: its kept host backups are in both
    figures.)"""
    ctl.sleep(1)
    ctl.wake_up()
    awake = rss(server)
    ctl.sleep(2)
    freed = awake - rss(server)
    assert ctl.collective_rpc("sleep_victims")[0] == [{}]
    assert freed >= (KV_GIB << 30) + 0.5 * weight_bytes(), f"level 2 freed {freed >> 20} MiB"
    return freed


def weight_bytes() -> int:
    return sum(2 * n for n in (_numel(s) for _, s in parameter_shapes(SPEC)))


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def test_level1_releases_the_kv_cache_and_output_is_identical(server, ctl, baseline):
    counted = scrape(server.url)
    before = rss(server)
    ctl.sleep(1)
    assert ctl.is_sleeping() is True
    freed = before - rss(server)
    print(f"\nlevel 1 freed {freed >> 20} MiB ({freed / (KV_GIB << 30):.1%} of the KV cache)")
    assert freed >= 0.9 * (KV_GIB << 30), f"freed {freed >> 20} MiB of a {KV_GIB} GiB KV cache"
    ctl.wake_up()
    assert ctl.is_sleeping() is False
    assert greedy_token_ids(server.url, PROBE, 24) == baseline
    now = scrape(server.url)  # the worker's own count, on the server's /metrics
    assert added(counted, now, "sleeps", level="1") == 1
    assert added(counted, now, "wakes", tags="all") == 1
    assert added(counted, now, "sleep_seconds") > 0 and added(counted, now, "wake_seconds") > 0


@pytest.mark.skipif(
    not has_route("/release_kv_cache_memory"),
    reason="vLLM 0.30.0 has no /release_kv_cache_memory (selective discard came later)",
)
def test_release_kv_cache_memory_discards_only_the_kv_cache(server, ctl, baseline):
    ctl.pause("wait")  # vLLM wants a completed pause with no request in flight
    before = pooled(server)
    r = requests.post(server.url + "/release_kv_cache_memory", timeout=120)
    assert r.status_code == 200, r.text
    freed = before - pooled(server)  # earlier wakes map lazily: count the pool, not RSS
    assert freed >= 0.9 * (KV_GIB << 30), f"freed {freed >> 20} MiB of a {KV_GIB} GiB KV cache"
    assert ctl.is_sleeping() is True
    ctl.wake_up(["kv_cache"])  # the weights never left: output is unchanged
    assert ctl.is_paused() is True  # the wake keeps the pause taken before the release
    ctl.resume()
    assert ctl.is_sleeping() is False
    assert greedy_token_ids(server.url, PROBE, 24) == baseline


@pytest.mark.parametrize("step, level", [("backup", 1), ("unmap", 2)])
def test_a_sleep_failing_at_any_allocation_leaves_the_engine_awake(
    server, ctl, baseline, step, level
):
    """A sleep is all or nothing: made to fail at the first, a middle and the last
    allocation it takes (a weight backup at level 1, as a pinned-memory shortage would; an
    unmap at level 2), it fails naming the step, every allocation stays mapped, and after the
    wake that resumes vLLM's paused scheduler the engine serves exactly the old output."""
    (victims,) = ctl.collective_rpc("sleep_victims")[0]
    count = victims["weights"] if step == "backup" else sum(victims.values())
    assert count >= 3, victims
    failing = "backing up" if step == "backup" else "unmapping"
    mapped = pooled(server)
    for at in (0, count // 2, count - 1):
        ctl.collective_rpc("fail_next_sleep", step=step, at=at)
        with pytest.raises(EngineControlError, match=f"failed {failing} allocation {at + 1} of"):
            ctl.sleep(level)
        assert pooled(server) == mapped, f"allocation {at + 1} of {count}: memory was released"
        ctl.wake_up()
        assert ctl.is_sleeping() is False
        assert greedy_token_ids(server.url, PROBE, 24) == baseline, f"allocation {at + 1}"


def test_a_wake_failing_halfway_rolls_back_and_the_next_wake_serves_the_old_output(
    server, ctl, baseline
):
    """A restore that fails in the middle of a level-1 wake (an ``aclrtMemcpy`` error) rolls
    the wake back: still asleep, backups kept; the next wake serves exactly the old output,
    every tensor where it was (the teardown's ledger check)."""
    weights = ctl.collective_rpc("sleep_victims")[0][0]["weights"]
    ctl.sleep(1)
    ctl.collective_rpc("fail_next_sleep", step="restore", at=weights // 2)
    with pytest.raises(EngineControlError, match="failed and was rolled back"):
        ctl.wake_up()
    assert ctl.is_sleeping() is True
    ctl.wake_up()
    assert ctl.is_sleeping() is False
    assert greedy_token_ids(server.url, PROBE, 24) == baseline


def test_level2_releases_the_weights_too_and_a_reload_from_disk_restores_them(
    server, ctl, baseline, model
):
    freed = level2_frees(server, ctl)
    print(f"\nlevel 2 freed {freed >> 20} MiB ({KV_GIB} GiB of KV cache, the weights)")
    ctl.wake_up(["weights"])
    ctl.reload_weights(str(model))
    ctl.wake_up(["kv_cache"])
    assert greedy_token_ids(server.url, PROBE, 24) == baseline


def test_level2_after_the_weight_checker_frees_the_weights_and_reloads(
    server, ctl, baseline, model
):
    """vLLM's /weight_checker digests every parameter through ``.numpy()``, which leaves a CPU
    storage never resizable again: level 2 must still free the weights, and a reload work."""
    if not has_route("/weight_checker"):
        pytest.skip("this vLLM has no /weight_checker (0.32 and later)")
    assert ctl.weight_checksums()
    level2_frees(server, ctl)
    ctl.wake_up(["weights"])
    ctl.reload_weights(str(model))
    ctl.wake_up(["kv_cache"])
    assert greedy_token_ids(server.url, PROBE, 24) == baseline


def test_level2_reload_by_a_weight_transfer(server, ctl, baseline, model, tmp_path):
    env = trainer_env(server.chips, colocated=True)
    with TrainerProcess(model, log_path=tmp_path / "trainer.log", env=env) as trainer:
        trainer.init("ascend_rl_npu_ipc", server.url, timeout_s=60)
        ctl.sleep(2)  # the colocated trainer would train now
        ctl.wake_up(["weights"])
        trainer.send(weight_version="after-sleep")
        ctl.wake_up(["kv_cache"])
    assert greedy_token_ids(server.url, PROBE, 24) == baseline


def test_no_request_runs_on_discarded_weights(server, ctl, baseline, model):
    ctl.sleep(2)
    waiting = StreamingCompletion(server.url, PROBE, 24, ignore_eos=False)
    waiting.start()
    with pytest.raises(EngineControlError, match="weights were discarded by a level-2 sleep"):
        ctl.wake_up()  # would let the request run on zeroed weights: refused
    time.sleep(1.0)
    assert waiting.is_alive() and waiting.num_tokens == 0
    assert server.is_healthy()
    ctl.wake_up(["weights"])
    ctl.reload_weights(str(model))
    ctl.wake_up(["kv_cache"])
    waiting.join(120)
    assert waiting.ok and waiting.token_ids == baseline


def test_staged_wake_keeps_the_scheduler_paused_until_everything_is_awake(server, ctl, baseline):
    ctl.sleep(1)
    waiting = StreamingCompletion(server.url, PROBE, 24, ignore_eos=False)
    waiting.start()
    ctl.wake_up(["weights"])
    assert ctl.is_sleeping() is True
    time.sleep(1.0)
    assert waiting.is_alive() and waiting.num_tokens == 0, "served before the KV cache woke"
    ctl.wake_up(["kv_cache"])
    waiting.join(120)
    assert waiting.ok and waiting.token_ids == baseline
    assert ctl.is_sleeping() is False


def test_an_invalid_sleep_level_is_refused(server, ctl, baseline):
    """vLLM 0.32 refuses level 3 at the route (4xx). vLLM 0.30.0's /sleep does not validate the
    level: the plugin scheduler refuses it before the engine pauses, and the workers would too
    (no weight is discarded)."""
    r = requests.post(server.url + "/sleep", params={"level": 3}, timeout=60)
    if sleep_route_validates_level():
        assert 400 <= r.status_code < 500, r.text
    else:
        assert r.status_code == 500 and "sleep level 3 is not supported" in r.text, r.text
        ctl.resume()  # harmless: nothing was paused
    assert ctl.is_sleeping() is False
    assert greedy_token_ids(server.url, PROBE, 24) == baseline


def test_repeated_calls_are_harmless(server, ctl, baseline):
    for _ in range(2):
        assert (
            requests.post(server.url + "/sleep", params={"level": 1}, timeout=120).status_code
            == 200
        )
    assert ctl.is_sleeping() is True
    for _ in range(2):
        assert requests.post(server.url + "/wake_up", timeout=120).status_code == 200
    assert ctl.is_sleeping() is False
    assert requests.post(server.url + "/wake_up", timeout=120).status_code == 200  # awake
    assert greedy_token_ids(server.url, PROBE, 24) == baseline


def test_twenty_cycles_keep_memory_and_output(server, ctl, baseline):
    """A leak per cycle: 0.4% of RSS over 20 cycles is 1% over 50, the bound per cycle."""
    ctl.sleep(1)
    ctl.wake_up()
    assert greedy_token_ids(server.url, PROBE, 24) == baseline
    start = rss(server)
    for i in range(20):
        ctl.sleep(1)
        ctl.wake_up()
        if i % 10 == 9:
            assert greedy_token_ids(server.url, PROBE, 24) == baseline, f"cycle {i + 1}"
    growth = rss(server) / start - 1
    print(f"RSS growth over 20 sleep/wake cycles: {growth:.4%}")
    assert growth < 0.004, f"RSS grew {growth:.2%} over 20 cycles"
