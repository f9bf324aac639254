"""The seed's async-RL e2e with the NPU-IPC engine on CPU (POSIX shared memory), its error
paths, and a leak test. The shared cases are in ``weight_sync_cases``."""

from __future__ import annotations

import contextlib
import json
import os
import time

import psutil
import pytest
import requests

from tests.e2e.weight_sync_cases import PROBE, WeightSyncCases
from tests.support import greedy_token_ids
from tests.support.profile import current_profile
from tests.support.trainer import TrainerError, TrainerProcess
from vllm_ascend_rl.client import EngineControlClient

pytestmark = [pytest.mark.e2e, pytest.mark.ascend, pytest.mark.timeout(900)]
USES_COMPILE_MODE_PAIR = True  # the NPU-IPC engine's shared server and its reference

GOOD_NAME_FORMAT = "vllm_ascend_rl_0123456789abcdef"  # well formed, never created
CHIP = "<chip>"  # stands for the engine worker's chip in the cases: see on_chip
NOBODY = "vllm_ascend_rl-00000000deadbeef"  # a doorbell address no trainer listens on
BAD_INIT = {  # case -> (init_info fields to change, None deletes; words the refusal contains)
    "missing_doorbells": ({"doorbells": None}, "doorbells: Field required"),
    "doorbells_not_a_dict": ({"doorbells": "x"}, "doorbells: Input should be a valid dictionary"),
    "doorbells_empty": ({"doorbells": {}}, "doorbells: Dictionary should have at least 1 item"),
    "doorbell_not_a_str": (
        {"doorbells": {CHIP: 5}},
        f"doorbells.{CHIP}: Input should be a valid string",
    ),
    "no_doorbell_for_chip": (
        {"doorbells": {"elsewhere": NOBODY}},
        f"no trainer rank on chip {CHIP}",
    ),
    "another_trainer": ({}, "the weight channel belongs to trainer"),  # the live owner's
    "zero_copy": ({"zero_copy": "yes"}, "zero_copy: Input should be a valid boolean"),
    "old_protocol": ({"protocol_version": 5}, "protocol_version: Unexpected keyword argument"),
    "bucket_bytes": (
        {"packed_buffer_size_bytes": 0},
        "packed_buffer_size_bytes: Input should be greater than 0",
    ),
    "timeout_s": ({"timeout_s": -1}, "timeout_s: Input should be greater than 0"),
    "on_failure": ({"on_failure": "later"}, "on_failure: Input should be 'restore' or 'hold'"),
    "unknown_field": ({"bogus": 1}, "bogus: Unexpected keyword argument"),
}


def on_chip(value, chip: str):
    """``value`` with CHIP replaced by ``chip`` (in keys and strings, at any depth)."""
    return json.loads(json.dumps(value).replace(CHIP, chip))


def _init_body(case: str) -> dict:
    init: dict = {"doorbells": {CHIP: NOBODY}, "timeout_s": 30}
    for field, value in BAD_INIT[case][0].items():
        if value is None:
            init.pop(field, None)
        else:
            init[field] = value
    return {"init_info": init}


def shm_entries() -> set[str]:
    return set(os.listdir("/dev/shm"))


def ring_mappings(pids: list[int]) -> list[str]:
    """The trainers' staging segments (CPU stand-in) that the processes ``pids`` map."""
    out = []
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as maps:
            out += [line.split(None, 5)[-1].strip() for line in maps if "/vllm_ascend_rl_" in line]
    return out


def unmapped_within(engine, timeout_s: float) -> None:
    t0 = time.monotonic()
    while held := ring_mappings(engine.pids()):
        assert time.monotonic() < t0 + timeout_s, f"still mapped after {timeout_s}s: {held}"
        time.sleep(0.2)


def rss(pids: list[int]) -> int:
    return sum(psutil.Process(p).memory_info().rss for p in pids)


class TestNPUIPCWeightSwap(WeightSyncCases):
    backend = "ascend_rl_npu_ipc"
    finish_fails_under = "hold"

    @pytest.fixture(scope="class")
    @classmethod
    def chip(cls, engine) -> str:
        """The engine worker's chip, as NPU IPC names it."""
        return current_profile().chip_name(engine.chips[0])

    @pytest.mark.parametrize(
        "buffers, message",
        [
            pytest.param("not-a-dict", "malformed buffers field", id="not_a_dict"),
            pytest.param({CHIP: "not-a-list"}, "malformed buffers field", id="not_a_list"),
            pytest.param(
                {"elsewhere": [{"id": "x"}]},
                f"no staging buffers for chip {CHIP}",
                id="other_chip_only",
            ),
            pytest.param(
                {CHIP: [{"id": "bad1", "kind": "shm", "name": "../../etc/passwd", "nbytes": 10}]},
                "malformed shared-memory handle: name '../../etc/passwd'",
                id="bad_name",
                marks=pytest.mark.cpu_only,
            ),
            pytest.param(
                {CHIP: [{"id": "bad2", "kind": "shm", "name": GOOD_NAME_FORMAT, "nbytes": "ten"}]},
                "malformed shared-memory handle: nbytes 'ten'",
                id="bad_size",
                marks=pytest.mark.cpu_only,
            ),
            pytest.param(
                {CHIP: [{"id": "bad3", "kind": "cuda_ipc", "handle": "..."}]},
                "not a shared-memory handle",
                id="wrong_kind",
                marks=pytest.mark.cpu_only,
            ),
        ],
    )
    def test_malformed_buffers_are_refused(
        self, engine, trainer, on_v1, v1_probe, chip, buffers, message
    ):
        self.init(trainer, engine)
        with pytest.raises(TrainerError, match="refused") as err:
            trainer.send(payload={"buffers": on_chip(buffers, chip)})
        assert on_chip(message, chip) in str(err.value)
        self.assert_alive_and_intact(engine, v1_probe)
        trainer.send(weight_version="v2")  # a refusal leaves the connection usable

    @pytest.mark.cpu_only
    def test_missing_segment_is_refused(self, engine, trainer, on_v1, v1_probe, chip):
        self.init(trainer, engine)
        handle = {
            "id": "gone",
            "kind": "shm",
            "name": GOOD_NAME_FORMAT,
            "nbytes": 1 << 20,
            "location": None,
        }
        with pytest.raises(TrainerError, match="refused"):
            trainer.send(payload={"buffers": {chip: [handle]}})
        handle["location"] = _location(chip)
        with pytest.raises(TrainerError, match=f"segment '{GOOD_NAME_FORMAT}' does not exist"):
            trainer.send(payload={"buffers": {chip: [handle]}})
        self.assert_alive_and_intact(engine, v1_probe)

    @pytest.mark.cpu_only
    def test_trainer_on_another_chip_is_named(self, engine, trainer, on_v1, v1_probe, chip):
        self.init(trainer, engine)
        elsewhere = {**_location(chip), "host": "trainer-host-b", "chip": "7"}
        handle = {
            "id": "far",
            "kind": "shm",
            "name": GOOD_NAME_FORMAT,
            "nbytes": 1 << 20,
            "location": elsewhere,
        }
        with pytest.raises(TrainerError) as err:
            trainer.send(payload={"buffers": {chip: [handle]}})
        host = _location(chip)["host"]
        assert (
            f"trainer on chip 7 of host trainer-host-b, engine on chip {chip} of host {host}"
        ) in str(err.value)
        self.assert_alive_and_intact(engine, v1_probe)

    @pytest.mark.cpu_only  # /dev/shm and host RSS are the CPU stand-in's resources
    def test_no_leak_over_100_updates(self, engine, trainer, on_v1):
        self.init(trainer, engine)
        for _ in range(10):  # warm up allocator pools and mappings
            trainer.send()
        shm_before = shm_entries()
        engine_before, trainer_before = rss(engine.pids()), rss([trainer.proc.pid])
        for i in range(100):
            trainer.send(weight_version=f"leak-{i}")
        shm_after = shm_entries()
        engine_after, trainer_after = rss(engine.pids()), rss([trainer.proc.pid])
        assert shm_after <= shm_before, f"new /dev/shm entries: {shm_after - shm_before}"
        assert not [n for n in shm_after if n.startswith("vllm_ascend_rl_")]
        growth = {
            "engine": engine_after / engine_before - 1,
            "trainer": trainer_after / trainer_before - 1,
        }
        print(
            f"RSS growth over 100 updates: {growth}; engine {engine_after >> 20} MiB, "
            f"trainer {trainer_after >> 20} MiB"
        )
        assert growth["engine"] <= 0.02 and growth["trainer"] <= 0.02, growth

    @pytest.mark.cpu_only  # the stand-in's rings are /dev/shm files in /proc/<pid>/maps
    def test_a_departed_trainers_ring_is_unmapped_within_its_timeout(
        self, engine, models, trainer, on_v1, tmp_path, plugin_env, chip
    ):
        """An idle engine drops every mapping of a trainer that shut its engine down or died,
        within timeout_s and without an init; the channel is free then (an init is judged on
        its own: here, nobody listens)."""
        timeout_s = 10
        env = self.trainer_env(plugin_env, engine)
        assert ring_mappings(engine.pids()), "no ring mapped: the checks below cannot fail"
        trainer.release(engine.url)  # a trainer that shuts its engine down
        unmapped_within(engine, timeout_s)
        with TrainerProcess(models[1], log_path=tmp_path / "killed.log", env=env) as killed:
            self.init(killed, engine, timeout_s=timeout_s)
            killed.send(weight_version="v2")
            assert ring_mappings(engine.pids()), "no ring mapped: the check below cannot fail"
            killed.proc.kill()  # a trainer that dies
            unmapped_within(engine, timeout_s)
        r = requests.post(
            engine.url + "/init_weight_transfer_engine",
            json=on_chip(_init_body("another_trainer"), chip),
            timeout=120,
        )
        assert r.status_code >= 400 and f"cannot reach the trainer's doorbell '{NOBODY}'" in r.text

    @pytest.mark.parametrize("case", list(BAD_INIT))
    def test_malformed_init_is_refused_and_spares_the_live_trainer(
        self, engine, reference, trainer, on_v1, v1_probe, chip, case
    ):
        """Refused at once, naming the field; the live trainer's connection still syncs."""
        t0 = time.monotonic()
        r = requests.post(
            engine.url + "/init_weight_transfer_engine",
            json=on_chip(_init_body(case), chip),
            timeout=120,
        )
        elapsed = time.monotonic() - t0
        assert r.status_code >= 400 and on_chip(BAD_INIT[case][1], chip) in r.text, r.text
        assert elapsed < 10, f"refused after {elapsed:.1f}s (timeout_s=30)"
        self.assert_alive_and_intact(engine, v1_probe)
        ctl = EngineControlClient(engine.url)
        ctl.pause(mode="abort")
        trainer.send(weight_version="v2")  # the connection made before the bad init
        ctl.resume()
        assert greedy_token_ids(engine.url, PROBE, 24) == greedy_token_ids(reference.url, PROBE, 24)


def _location(chip: str) -> dict:
    """The CPU stand-in's location of the engine worker on ``chip``."""
    from vllm_ascend_rl.device import get_device

    return {**get_device("cpu").location(), "chip": chip}
