"""Bad bodies, dead trainers and unpaused updates against a real server (HCCL engine).

Every case ends with the engine healthy and its greedy output equal to what it was on v1 before
the fault: a half-applied update looks alive, so "intact" is checked on tokens. One engine, one
v2 reference and one trainer serve the whole module.
"""

from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from tests.e2e.weight_sync_cases import PROBE, SMALL_BUCKET, WeightSyncServers, init_trainer
from tests.support import StreamingCompletion, greedy_token_ids
from tests.support.profile import trainer_env
from tests.support.tiny_model import TinyModelSpec, build_tiny_model, parameter_shapes
from tests.support.trainer import TrainerError, TrainerProcess
from vllm_ascend_rl.client import EngineControlClient, EngineControlError

pytestmark = [pytest.mark.e2e, pytest.mark.reliability, pytest.mark.timeout(900)]

GOOD_INIT = {"master_address": "127.0.0.1", "master_port": 29999, "world_size": 2}
BAD_INIT = {  # case -> (init_info fields to change, None deletes; words the refusal contains)
    "missing_field": (  # vLLM's own wording (WeightTransferEngine.parse_init_info)
        {"master_address": None},
        "Invalid init_info for AscendRLHCCLWeightTransferEngine: master_address: Field required",
    ),
    "master_address": ({"master_address": 7}, "master_address: Input should be a valid string"),
    "master_port": ({"master_port": "29999"}, "master_port: Input should be a valid integer"),
    "world_size": ({"world_size": [2]}, "world_size: Input should be a valid integer"),
    "packed": ({"packed": "yes"}, "packed: Input should be a valid boolean"),
    "bucket_bytes": (
        {"packed_buffer_size_bytes": -1},
        "packed_buffer_size_bytes: Input should be greater than 0",
    ),
    "num_buffers": (
        {"packed_num_buffers": 0},
        "packed_num_buffers: Input should be greater than or equal to 1",
    ),
    "timeout_s": ({"timeout_s": 0}, "timeout_s: Input should be greater than 0"),
    "rank_offset": ({"rank_offset": 0}, "rank_offset: Input should be greater than or equal to 1"),
    "unknown_field": ({"unknown_field": "x"}, "unknown_field: Unexpected keyword argument"),
    "world_of_one": ({"world_size": 1}, "world_size: Input should be greater than or equal to 2"),
    "no_rank_left": ({"rank_offset": 2}, "leaves no rank for engine worker"),
    "on_failure": ({"on_failure": "ignore"}, "on_failure: Input should be 'restore' or 'hold'"),
}
NAME = "model.norm.weight"
BAD_UPDATE = {  # update_info -> words the refusal must contain
    "shape_is_int": (
        {"names": [NAME], "dtype_names": ["bfloat16"], "shapes": [128]},
        "Invalid update_info for AscendRLHCCLWeightTransferEngine: "
        "shapes[0]: Input should be a valid list",
    ),
    "dtype_is_int": (
        {"names": [NAME], "dtype_names": [16], "shapes": [[128]]},
        "dtype_names[0]: Input should be a valid string",
    ),
    "name_is_list": (
        {"names": [[NAME]], "dtype_names": ["bfloat16"], "shapes": [[128]]},
        "names[0]: Input should be a valid string",
    ),
    "missing_field": ({"names": [NAME], "shapes": [[128]]}, "dtype_names"),
    "lengths_differ": (
        {"names": [NAME, NAME], "dtype_names": ["bfloat16"], "shapes": [[128]]},
        "differ in length",
    ),
    "unknown_dtype": (
        {"names": [NAME], "dtype_names": ["bfloat17"], "shapes": [[128]]},
        "unknown dtype 'bfloat17'",
    ),
    "negative_dim": (
        {"names": [NAME], "dtype_names": ["bfloat16"], "shapes": [[-128]]},
        "malformed shape [-128]",
    ),
    "not_a_dict": ("names", "update_info"),
}
KILL_AT = [2, 35, 60, 90]  # percent of the tensors sent before the trainer dies


def _post(url: str, route: str, body: dict | None = None) -> requests.Response:
    return requests.post(url + route, json=body, timeout=120)


def _init_body(case: str) -> dict:
    init = dict(GOOD_INIT)
    for field, value in BAD_INIT[case][0].items():
        if value is None:
            del init[field]
        else:
            init[field] = value
    return {"init_info": init}


class TestHCCLUpdateFaults(WeightSyncServers):
    backend = "ascend_rl_hccl"

    @pytest.fixture
    def on_v1_paused(self, on_v1, engine):
        ctl = EngineControlClient(engine.url)
        ctl.pause(mode="abort")
        yield ctl
        ctl.resume()

    @pytest.mark.parametrize("case", list(BAD_INIT))
    def test_malformed_init_is_refused_naming_the_field(self, engine, on_v1, v1_probe, case):
        r = _post(engine.url, "/init_weight_transfer_engine", _init_body(case))
        assert r.status_code >= 400 and BAD_INIT[case][1] in r.text, r.text
        self.assert_alive_and_intact(engine, v1_probe)

    @pytest.mark.parametrize("case", list(BAD_UPDATE))
    def test_malformed_update_ends_the_update_and_keeps_the_connection(
        self, engine, trainer, on_v1_paused, v1_probe, case
    ):
        body, words = BAD_UPDATE[case]
        assert _post(engine.url, "/start_weight_update", {}).status_code == 200
        r = _post(engine.url, "/update_weights", {"update_info": body})
        assert r.status_code >= 400 and words in r.text, r.text
        if r.status_code == 400:  # vLLM's route refused it: the engine never saw it
            assert _post(engine.url, "/finish_weight_update", {}).status_code == 200
        # The update is over: a new one opens (and, with nothing sent, changes nothing).
        assert _post(engine.url, "/start_weight_update", {}).status_code == 200
        assert _post(engine.url, "/finish_weight_update", {}).status_code == 200
        on_v1_paused.resume()
        self.assert_alive_and_intact(engine, v1_probe)
        if case == "shape_is_int":  # the trainer's connection was not touched
            on_v1_paused.pause(mode="abort")
            trainer.send(weight_version="v2")
            on_v1_paused.resume()
            assert greedy_token_ids(engine.url, PROBE, 24) != v1_probe

    @pytest.mark.parametrize("percent", KILL_AT)
    def test_trainer_killed_mid_sync_leaves_the_old_weights(
        self, engine, reference, models, trainer, on_v1, v1_probe, tmp_path, plugin_env, percent
    ):
        n = len(parameter_shapes(TinyModelSpec()))
        env = self.trainer_env(plugin_env, engine)
        trainer.release(engine.url)  # the channel's owner lets another trainer in
        with TrainerProcess(models[1], log_path=tmp_path / "doomed.log", env=env) as doomed:
            self.init(doomed, engine, packed_buffer_size_bytes=SMALL_BUCKET, timeout_s=10)
            with pytest.raises(TrainerError, match="exited"):
                doomed.send(die_after_tensors=max(1, n * percent // 100))
        self.assert_alive_and_intact(engine, v1_probe)
        self.init(trainer, engine)  # a new trainer inits and syncs completely
        trainer.send(weight_version="v2")
        assert greedy_token_ids(engine.url, PROBE, 24) == greedy_token_ids(reference.url, PROBE, 24)

    @pytest.mark.parametrize("percent", KILL_AT)
    def test_hold_mode_generates_nothing_until_a_complete_sync(
        self, engine, reference, models, trainer, on_v1, v1_probe, tmp_path, plugin_env, percent
    ):
        """on_failure="hold": no copy of the old weights. The trainer pauses (keep) and dies
        mid-sync. Once a layer took new weights, nothing is generated (a request waits,
        /resume is refused, naming the version that is partly loaded) until a new trainer
        completes a sync; then /resume works. A crash before any layer took new weights
        (possible at 2 %) leaves the old model whole, and it resumes at once."""
        n = len(parameter_shapes(TinyModelSpec()))
        env = self.trainer_env(plugin_env, engine)
        trainer.release(engine.url)  # the channel's owner lets another trainer in
        with TrainerProcess(models[1], log_path=tmp_path / "doomed.log", env=env) as doomed:
            self.init(
                doomed,
                engine,
                packed_buffer_size_bytes=SMALL_BUCKET,
                timeout_s=10,
                on_failure="hold",
            )
            with pytest.raises(TrainerError, match="exited"):
                doomed.send(
                    weight_version="v2-partial", die_after_tensors=max(1, n * percent // 100)
                )
        waiting = StreamingCompletion(engine.url, PROBE, 24, ignore_eos=False)
        waiting.start()
        time.sleep(1.5)
        if percent == KILL_AT[0] and not waiting.is_alive():  # no layer had changed
            assert waiting.ok and waiting.token_ids == v1_probe
            return
        assert waiting.is_alive() and waiting.num_tokens == 0, "generated from a mixed model"
        r = _post(engine.url, "/resume")
        assert r.status_code >= 400 and "not whole" in r.text, r.text
        assert "of version 'v2-partial' failed after" in r.text, r.text
        assert engine.is_healthy()
        self.init(trainer, engine)
        trainer.send(weight_version="v2")  # complete: the weights are whole again
        assert _post(engine.url, "/resume").status_code == 200
        waiting.join(120)
        assert waiting.ok and waiting.token_ids == greedy_token_ids(reference.url, PROBE, 24)

    def test_hold_an_update_abandoned_before_any_weight_resumes_on_the_old_weights(
        self, engine, reference, models, trainer, on_v1, v1_probe, tmp_path, plugin_env
    ):
        """on_failure="hold", and the trainer is gone right after it paused and started an
        update: a request waits while paused; /resume is accepted (no weight arrived), no step
        runs until the scheduler ends the update that saw no call for timeout_s (6 s), and the
        request completes on the old weights. The next trainer then syncs normally."""
        ctl = EngineControlClient(engine.url)
        env = self.trainer_env(plugin_env, engine)
        trainer.release(engine.url)  # the channel's owner lets another trainer in
        with TrainerProcess(models[1], log_path=tmp_path / "gone.log", env=env) as gone:
            self.init(gone, engine, timeout_s=6, on_failure="hold")
            ctl.pause(mode="keep")
            assert _post(engine.url, "/start_weight_update", {}).status_code == 200
        waiting = StreamingCompletion(engine.url, PROBE, 24, ignore_eos=False)
        waiting.start()
        time.sleep(2)
        assert waiting.is_alive() and waiting.num_tokens == 0, "generated while paused"
        assert _post(engine.url, "/resume").status_code == 200
        waiting.join(60)
        assert waiting.ok and waiting.token_ids == v1_probe
        self.init(trainer, engine)
        trainer.send(weight_version="v2")
        assert greedy_token_ids(engine.url, PROBE, 24) == greedy_token_ids(reference.url, PROBE, 24)

    @pytest.mark.parametrize("paused", [True, False], ids=["paused", "generating"])
    def test_trainer_killed_before_finish_leaves_a_whole_model(
        self, engine, reference, models, trainer, on_v1, v1_probe, tmp_path, plugin_env, paused
    ):
        """Every weight arrived, finish never came. Generating: no step runs while the update
        is open; once it saw no call for the connection's timeout_s (10 s) the engine ends it,
        the old weights come back and the waiting request completes on them. Paused: the next
        trainer's start ends the abandoned update, and its own sync then lands exactly."""
        ctl = EngineControlClient(engine.url)
        env = self.trainer_env(plugin_env, engine)
        trainer.release(engine.url)  # the channel's owner lets another trainer in
        with TrainerProcess(models[1], log_path=tmp_path / "doomed.log", env=env) as doomed:
            self.init(doomed, engine, timeout_s=10)
            if paused:
                ctl.pause(mode="abort")
            with pytest.raises(TrainerError, match="exited"):
                doomed.send(die_before_finish=True)
        if not paused:
            self.assert_alive_and_intact(engine, v1_probe)
        self.init(trainer, engine)
        trainer.send(weight_version="v2")
        ctl.resume()
        assert greedy_token_ids(engine.url, PROBE, 24) == greedy_token_ids(reference.url, PROBE, 24)

    def test_generation_waits_for_an_update_opened_by_hand(self, engine, on_v1, v1_probe):
        """Not paused: no step runs from start_weight_update to finish_weight_update (here
        with nothing received: the old weights stay), and the waiting request then completes."""
        assert _post(engine.url, "/start_weight_update", {}).status_code == 200
        with ThreadPoolExecutor(1) as pool:
            probe = pool.submit(greedy_token_ids, engine.url, PROBE, 24)
            time.sleep(1.0)
            assert not probe.done(), "a request completed while an update was open"
            assert _post(engine.url, "/finish_weight_update", {}).status_code == 200
            assert probe.result(60) == v1_probe
        self.assert_alive_and_intact(engine, v1_probe)

    @pytest.mark.parametrize("case", ["missing_path", "other_shape", "truncated_file"])
    def test_reload_from_disk_is_checked_before_the_model_is_touched(
        self, engine, models, on_v1, v1_probe, tmp_path, case
    ):
        """``reload_weights`` (the level-2 sleep recipe's step) from a path that is not there,
        a checkpoint of another shape, or a file cut short: a clear error, the old weights."""
        if case == "missing_path":
            path, words = tmp_path / "nowhere", "does not exist on the server"
        elif case == "other_shape":
            path = build_tiny_model(TinyModelSpec(intermediate_size=384), cache_dir=tmp_path)
            words = "shape [128, 384] does not match the model's [128, 256]"
        else:
            path = shutil.copytree(models[1], tmp_path / "cut")
            file = path / "model.safetensors"
            os.truncate(file, file.stat().st_size - 1024)
            words = "incomplete metadata"
        with pytest.raises(EngineControlError, match="reload_weights") as e:
            EngineControlClient(engine.url).reload_weights(str(path))
        assert words in str(e.value), e.value
        self.assert_alive_and_intact(engine, v1_probe)

    def test_reload_from_disk_loads_a_fitting_checkpoint(self, engine, reference, models, on_v1):
        EngineControlClient(engine.url).reload_weights(str(models[1]))
        v2_probe = greedy_token_ids(reference.url, PROBE, 24)
        assert greedy_token_ids(engine.url, PROBE, 24) == v2_probe


def test_an_engine_without_a_step_gate_is_synced_only_while_paused(
    reference_v1, references_v2, model_pair, tmp_path
):
    """vLLM's own scheduler (the shared v1 reference, with the plugin's HCCL engine) holds no
    step during an update. An unpaused sync while requests stream is refused before the update
    opens, naming what to do; the streams and the weights are untouched. A paused sync lands,
    and a second one puts v1 back."""
    engine, v1, v2 = reference_v1, *model_pair
    v1_probe = greedy_token_ids(engine.url, PROBE, 24)
    env = trainer_env(engine.chips, colocated=False)
    with TrainerProcess(v2, log_path=tmp_path / "trainer.log", env=env) as trainer:
        init_trainer("ascend_rl_hccl", trainer, engine)
        streams = [StreamingCompletion(engine.url, f"No gate {i}:", 300) for i in range(4)]
        for s in streams:
            s.start()
        while min(s.num_tokens for s in streams) < 8:
            time.sleep(0.01)
        with pytest.raises(TrainerError, match="its scheduler has no step gate") as refused:
            trainer.send(weight_version="v2", pause=False)
        assert "and it is not paused" in str(refused.value) and "Pause it first" in str(
            refused.value
        )
        for s in streams:
            s.join(120)
            assert s.ok and s.finish_reason == "length" and s.num_tokens == 300, s.error
        assert greedy_token_ids(engine.url, PROBE, 24) == v1_probe
        try:
            trainer.send(weight_version="v2")  # paused (keep) for the sync, resumed after
            v2_probe = greedy_token_ids(references_v2("ascend_rl_hccl").url, PROBE, 24)
            assert greedy_token_ids(engine.url, PROBE, 24) == v2_probe
        finally:
            trainer.load(v1)
            trainer.send(weight_version="v1")  # the pause drops v2's prefix cache too
            trainer.release(engine.url)
    assert greedy_token_ids(engine.url, PROBE, 24) == v1_probe
    assert "cancelled because generation ran" not in engine.log_path.read_text(errors="replace")
