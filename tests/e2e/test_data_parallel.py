"""Data parallel with internal load balancing: one server with ``--data-parallel-size 2``.

Each DP rank is its own engine core with its own worker. One ``/pause`` must stop both, one
HCCL sync must reach both (world size = 1 trainer + 2 workers; worker rank = dp_index x
workers_per_rank + rank + 1), and every stream, whichever rank serves it, must continue on the
new weights exactly as a fresh engine on them would. Sleep and wake must reach both ranks:
each rank's worker process frees its KV cache.
"""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest
import requests

from tests.e2e.weight_sync_cases import PROBE, init_trainer
from tests.support import (
    VLLMServer,
    build_model_pair,
    greedy_token_ids,
    rl_engine_args,
)
from tests.support.doctor import engine_checks
from tests.support.profile import trainer_env
from tests.support.rl_step import check_continuations, swap_mid_generation, swap_unpaused
from tests.support.trainer import TrainerProcess
from vllm_ascend_rl.client import EngineControlClient

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


def dp2_engine(log_dir: Path) -> list[VLLMServer]:
    # Both ranks' compute on one core: the API server streams every rank's tokens, and on a
    # 2-core host with a rank on each core it fell seconds behind (pauses and syncs then landed
    # after the streams had ended). The ranks are still two engine cores and two workers.
    core = min(os.sched_getaffinity(0))
    return [
        VLLMServer(
            build_model_pair()[0],
            log_path=log_dir / "engine-dp2.log",
            env={"VLLM_CPU_OMP_THREADS_BIND": f"{core}|{core}"},
            chips=2,
            extra_args=[
                *rl_engine_args("ascend_rl_hccl", sleepable=True),
                *("--data-parallel-size", "2"),
            ],
        )
    ]


SERVERS = (dp2_engine,)


@pytest.fixture(scope="module")
def servers(server_plan, model_pair, reference_v2):
    with server_plan.serving(dp2_engine) as (engine,):
        yield engine, reference_v2, model_pair[1]


@pytest.fixture(scope="module")
def trainer(servers, model_pair, tmp_path_factory):
    """A trainer holding v2, connected to both ranks' workers (world size 1 + 2)."""
    engine, _, v2 = servers
    log = tmp_path_factory.mktemp("dp-trainer") / "trainer.log"
    env = trainer_env(engine.chips, colocated=False)
    with TrainerProcess(v2, log_path=log, env=env) as t:
        # The engine ends an update that sees no call for timeout_s. Both ranks stream 6 x 900
        # tokens in the unpaused test, and on a loaded 2-core host the API server passed the
        # update's next call on more than 30 s after its start (CI): 120 s here.
        init_trainer("ascend_rl_hccl", t, engine, world_size=3, timeout_s=120)
        yield t


def test_one_pause_and_one_sync_reach_both_ranks(servers, trainer):
    engine, reference, _ = servers
    assert EngineControlClient(engine.url).world_size() == 2
    # 1500 tokens a stream: an idle DP rank decodes the tiny model in a few ms a token, a DP
    # pause is acknowledged only once both ranks have stopped, and the API server of two ranks
    # on a loaded 2-core host answered each probe's pause after every stream had ended (CI:
    # split [600, 600, 600, 600] in five rounds; with 200 tokens once in one round).
    sync = lambda: trainer.send(weight_version="v2")  # noqa: E731
    out = swap_mid_generation(engine.url, sync, max_tokens=1500)
    assert not out.problems, out.problems
    assert all(k > 0 for k in out.split), out.split
    assert check_continuations(reference.url, out) == [True] * len(out.streams)
    log = engine.log_path.read_text(errors="replace")
    for rank in (1, 2):  # both DP ranks' workers joined the one group
        assert f"HCCL weight transfer ready: rank {rank} of 3" in log
    assert greedy_token_ids(engine.url, PROBE, 16) == greedy_token_ids(reference.url, PROBE, 16)


def generated_by_rank(url: str) -> dict[str, float]:
    """vLLM's generation-token counter of each DP rank's engine core."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(url + "/metrics", timeout=30).text
    return {
        s.labels["engine"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "vllm:generation_tokens_total"
    }


def test_an_unpaused_sync_is_held_on_each_rank_and_every_stream_continues_exactly(
    servers, trainer, model_pair, reference_v1
):
    """Each rank's engine core has a step gate of its own: both ranks generate, the trainer
    syncs without a pause, and every stream, on either rank, is an old-weights prefix followed
    by the new weights' exact greedy continuation."""
    engine, reference, _ = servers

    def on_v1() -> None:
        trainer.load(model_pair[0])
        trainer.send(weight_version="v1")  # paused
        trainer.load(model_pair[1])

    on_v1()  # the test before synced v2
    assert greedy_token_ids(engine.url, PROBE, 16) == greedy_token_ids(reference_v1.url, PROBE, 16)
    before = generated_by_rank(engine.url)
    prompts = [f"Rank stream {i}:" for i in range(6)]
    # Two ranks decode fast, and on a loaded 2-core host the API server delivered a stream's
    # 217th token after its engine had finished all 600 (CI): a round in which a stream ended
    # before the sync is run again, on v1 again.
    sync = lambda: trainer.send(weight_version="v2", pause=False)  # noqa: E731
    out = swap_unpaused(engine.url, sync, prompts=prompts, max_tokens=900, restore=on_v1)
    after = generated_by_rank(engine.url)
    assert sorted(after) == ["0", "1"] and all(after[r] > before.get(r, 0) for r in after), after
    assert not out.problems, out.problems
    # Each rank decodes a batch of its own: the references run one request at a time.
    assert check_continuations(reference.url, out) == [True] * len(prompts)
    log = engine.log_path.read_text(errors="replace")
    assert "cancelled because generation ran" not in log and "no step gate" not in log


def rank_rss(server: VLLMServer) -> dict[str, int]:
    """Resident bytes per DP rank: its engine core process and its worker process."""
    out = {}
    for pid in server.pids():
        try:
            core = psutil.Process(pid)
            if "EngineCore" in core.name():
                procs = [core, *core.children(recursive=True)]
                out[core.name()] = sum(p.memory_info().rss for p in procs)
        except psutil.NoSuchProcess:
            pass
    return out


def test_sleep_and_wake_reach_both_ranks(servers):
    engine, _, _ = servers
    ctl = EngineControlClient(engine.url, timeout_s=120)
    before_tokens = greedy_token_ids(engine.url, PROBE, 16)
    awake = rank_rss(engine)
    assert len(awake) == 2, awake
    ctl.sleep(1)
    assert ctl.is_sleeping() is True
    asleep = rank_rss(engine)
    freed = {name: awake[name] - asleep[name] for name in awake}
    print(f"\nlevel 1 freed per DP rank: { {n: f >> 20 for n, f in freed.items()} } MiB")
    assert all(f >= 0.9 * (1 << 30) for f in freed.values()), freed  # each rank's 1 GiB KV
    ctl.wake_up()
    assert ctl.is_sleeping() is False
    assert greedy_token_ids(engine.url, PROBE, 16) == before_tokens


def test_the_doctor_fails_engines_of_different_world_sizes(servers, rl_engines):
    """One trainer syncs several engines with one recipe: the doctor compares them."""
    engine, _, _ = servers
    single = rl_engines("ascend_rl_hccl").url
    checks = engine_checks(engine.url, single)
    check = checks["engines: same world_size"]
    assert check["status"] == "fail"
    assert check["found"] == f"{engine.url}: 2, {single}: 1"
    assert "same TP x PP x DP" in check["fix"]
    assert [c["name"] for c in checks.values() if c["status"] == "fail"] == ["same world_size"]
