"""Where the e2e suites put servers and trainers on an NPU host (``examples/plumbing/profile.py``
and ``tests/support/profile.py``): each server on chips of its own while it runs, NPU-IPC
trainer ranks on their engine worker's chip, HCCL trainer ranks on a chip of their own. Pure
bookkeeping, so CPU CI checks it."""

from __future__ import annotations

import pytest

from examples.plumbing import profile  # the chip pool's module: its _POOL is reset
from tests.support.profile import ChipPool, current_profile, trainer_chip, trainer_env


@pytest.fixture
def npu_host(monkeypatch):
    """An NPU profile on a host whose visible chips are 4..7 (logical 0..3)."""
    monkeypatch.setenv("VLLM_ASCEND_RL_DEVICE", "npu")
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "4,5,6,7")
    monkeypatch.setattr(profile, "_POOL", None)
    return current_profile()


def test_servers_take_the_lowest_free_chips_and_give_them_back(npu_host):
    engine, reference, tp2 = object(), object(), object()
    assert npu_host.take_chips(engine, 1) == [0]
    assert npu_host.take_chips(reference, 1) == [1]
    assert npu_host.take_chips(tp2, 2) == [2, 3]
    assert npu_host.chip_sharers(engine) == []
    npu_host.give_back_chips(reference)
    assert npu_host.take_chips(object(), 1) == [1]


def test_on_a_host_with_too_few_chips_servers_share_the_least_used(npu_host):
    servers = [object() for _ in range(5)]
    taken = [npu_host.take_chips(s, 1) for s in servers]
    assert taken == [[0], [1], [2], [3], [0]]
    assert npu_host.chip_sharers(servers[4]) == [servers[0]]
    assert npu_host.chip_sharers(servers[0]) == [servers[4]]
    with pytest.raises(RuntimeError, match="needs 5 chips; this host has 4"):
        npu_host.take_chips(object(), 5)


def test_the_pool_counts_the_visible_chips(npu_host):
    assert profile.chip_pool().count == 4


def test_colocated_trainer_ranks_sit_on_their_engine_workers_chips(npu_host):
    assert [trainer_chip([2, 3], colocated=True, rank=r) for r in (0, 1)] == [2, 3]
    assert trainer_env([2, 3], colocated=True, rank=1) == {"ASCEND_RT_VISIBLE_DEVICES": "7"}


def test_hccl_trainer_ranks_take_the_highest_chips_the_engine_does_not_use(npu_host):
    assert trainer_chip([0], colocated=False) == 3
    assert trainer_chip([2, 3], colocated=False, rank=0) == 1
    assert trainer_chip([2, 3], colocated=False, rank=1) == 0
    assert trainer_chip(2, colocated=False) == 3  # an engine alone: chips 0 and 1
    with pytest.raises(RuntimeError, match="needs a chip of its own"):
        trainer_chip([0, 1, 2, 3], colocated=False)


def test_cpu_servers_take_emulated_chips_that_share_one_memory_ledger(monkeypatch):
    monkeypatch.setenv("VLLM_ASCEND_RL_DEVICE", "cpu")
    monkeypatch.setattr(profile, "_POOL", None)
    cpu = current_profile()
    a, b = object(), object()
    assert profile.chip_pool().count == profile.ascend_runner()["chips"] == 2  # the runner's
    assert cpu.take_chips(a, 2) == [0, 1] and cpu.take_chips(b, 1) == [0]
    assert cpu.chip_sharers(b) == [a]
    env = cpu.chips_env([1])
    assert env["VLLM_ASCEND_RL_CPU_CHIPS"] == "1"
    assert env["VLLM_ASCEND_RL_CPU_CHIP_BYTES"] == str(64 << 30)  # the runner's chip memory
    assert (
        env["VLLM_ASCEND_RL_CPU_CHIP_LEDGER"]
        == cpu.chips_env([0, 1])["VLLM_ASCEND_RL_CPU_CHIP_LEDGER"]
    )
    # A CPU trainer rank r emulates logical chip r: colocated, it sees its engine's chips.
    assert trainer_env([0, 1], colocated=True, rank=1)["VLLM_ASCEND_RL_CPU_CHIPS"] == "0,1"
    assert trainer_env([0, 1], colocated=False) == {}


def test_a_pool_of_one_chip_is_shared_by_every_server():
    pool, a, b = ChipPool(1), object(), object()
    assert pool.take(a, 1) == pool.take(b, 1) == [0]
    pool.give_back(a)
    assert pool.sharers(b) == []


def test_every_cpu_server_worker_runs_on_an_emulated_chip(monkeypatch, tmp_path):
    """Reference servers too: a layout that starts one beside an engine on its chip fails."""
    monkeypatch.setenv("VLLM_ASCEND_RL_DEVICE", "cpu")
    from tests.support import VLLMServer, rl_engine_args

    def worker_cls(server: VLLMServer) -> str:
        args = server.command()
        assert args.count("--worker-cls") == 1, args
        return args[args.index("--worker-cls") + 1]

    log = tmp_path / "server.log"
    assert worker_cls(VLLMServer("m", log_path=log)).endswith(".ChipCPUWorker")
    sleepable = VLLMServer("m", log_path=log, extra_args=rl_engine_args(sleepable=True))
    assert worker_cls(sleepable).endswith(".SleepableCPUWorker")


TRAINER_ROOM = 0.25  # of each chip, for trainer processes (torch_npu context, HCCL, buckets)


def module_servers(log_dir) -> list:
    """Every test module's servers (``SERVERS``), built as the suite builds them, not started."""
    import importlib
    import pkgutil

    import tests.e2e
    import tests.reliability

    servers = []
    for package in (tests.e2e, tests.reliability):
        for info in pkgutil.iter_modules(package.__path__):
            module = importlib.import_module(f"{package.__name__}.{info.name}")
            for make in getattr(module, "SERVERS", ()):
                servers += make(log_dir)
    return servers


def test_the_suites_layout_fits_the_ascend_runner_with_room_for_trainers(tmp_path):
    """The suite as it is, on the runner's chips, every server asking MEMORY_FRACTION of each
    of its chips: the shared servers, then any two modules' servers at once (on CPU the next
    module's starts while one runs; on NPU one module's at a time) leave every chip
    TRAINER_ROOM; at 0.2 the same layout asked all of chip 0 (V6)."""
    from itertools import combinations

    from examples.plumbing.profile import MEMORY_FRACTION, ascend_runner
    from tests.support.shared_servers import SHARED

    chips, chip_counts = ascend_runner()["chips"], [s.num_chips for s in module_servers(tmp_path)]
    assert len(chip_counts) >= 8 and max(chip_counts) == chips  # TP=2 and DP=2 servers

    def most_asked(fraction: float) -> float:
        worst = 0.0
        for a, b in combinations(chip_counts, 2):
            pool = ChipPool(chips)
            for name in SHARED:
                pool.take(name, 1, fraction)
            pool.take("module", a, fraction)
            pool.take("next module", b, fraction)
            worst = max(worst, *(asked for _, asked in pool.peak.values()))
        return worst

    assert most_asked(float(MEMORY_FRACTION)) <= 1 - TRAINER_ROOM
    assert most_asked(0.2) == pytest.approx(1.0)  # 3 shared + 2 modules on chip 0, no room
