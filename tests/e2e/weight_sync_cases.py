"""The weight-swap e2e shared by every weight-transfer backend (HCCL, NPU-IPC).

A test class sets ``backend`` and subclasses :class:`WeightSyncCases`. Per backend, shared by
every class of the session: one engine server on v1 weights with ``--weight-transfer-config
'{"backend": <backend>}'`` and the plugin scheduler, beside vllm-ascend's registrations (on an
Ascend host the real vllm-ascend's, elsewhere a stand-in's, discovered first). The session's
reference servers on v1 and v2 validate; each class has a trainer process holding v2.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from typing import ClassVar

import pytest
import requests

from tests.support import VLLMServer, free_port, greedy_token_ids
from tests.support.addresses import assert_addresses_kept
from tests.support.metrics import added, scrape, scrape_text, series
from tests.support.profile import trainer_env
from tests.support.rl_step import check_continuations, swap_mid_generation, swap_unpaused
from tests.support.tiny_model import TinyModelSpec, mixed_checkpoint, parameter_shapes
from tests.support.trainer import TrainerError, TrainerProcess
from tests.support.vllm_features import has_route
from vllm_ascend_rl.client import EngineControlClient, EngineControlError

PROBE = "Weights under test:"
UNKNOWN = "model.norm.weight_unknown"
SMALL_BUCKET = 64 << 10  # smaller than the largest tensor (embed/lm_head: 512 x 128 bf16)
# The default packed wire is the examples' (tests/e2e/test_examples.py runs them, validated).
WIRES = {
    "unpacked": {"packed": False},
    "small_bucket": {
        "packed": True,
        "packed_buffer_size_bytes": SMALL_BUCKET,
        "packed_num_buffers": 3,
    },
}
BAD_METADATA = {
    "unknown_name": (
        {"rename": "model.layers.1.mlp.up_proj.weight"},
        "unknown parameter 'model.layers.1.mlp.up_proj.weight_unknown'",
    ),
    "oversized_shape": (
        {"grow": "model.layers.0.mlp.gate_proj.weight"},
        "'model.layers.0.mlp.gate_proj.weight': shape [320, 128]",
    ),
    "float32": (
        {"dtype": "float32", "dtype_param": "model.norm.weight"},
        "'model.norm.weight': dtype float32",
    ),
    "int32": ({"dtype": "int32", "dtype_param": "lm_head.weight"}, "'lm_head.weight': dtype int32"),
    "part_of_a_layer": (  # v is fused with q and k into one qkv_proj
        {"freeze": ["model.layers.1.self_attn.v_proj."]},
        "layer 'model.layers.1.self_attn.qkv_proj' would receive only part of its weights",
    ),
}
FROZEN = ["model.embed_tokens.", "model.layers.0."]  # modules a partial update leaves out
NO_BYTES = hashlib.sha256(b"").hexdigest()  # a tensor vLLM emptied (CPU prepacked linear)


def staging_segments() -> set[str]:
    """The NPU-IPC trainers' staging segments on CPU (none on NPU or with HCCL)."""
    if not os.path.isdir("/dev/shm"):
        return set()
    return {n for n in os.listdir("/dev/shm") if n.startswith("vllm_ascend_rl_")}


def start_refusal(url: str) -> str:
    """Why the engine refuses ``/start_weight_update`` now (it must refuse)."""
    r = requests.post(url + "/start_weight_update", json={}, timeout=60)
    assert r.status_code >= 400, "start_weight_update was accepted"
    return r.text


def init_trainer(backend: str, trainer: TrainerProcess, engine: VLLMServer, **kw) -> None:
    """``trainer_init`` for ``backend`` with test-friendly defaults."""
    kw.setdefault("timeout_s", 30)
    if backend == "ascend_rl_hccl":
        kw.setdefault("world_size", 2)
        kw.setdefault("master_address", "127.0.0.1")
        kw.setdefault("master_port", free_port())
    trainer.init(backend, engine.url, **kw)


class WeightSyncServers:
    """The backend's shared engine (on v1 at the start of every test, through ``on_v1``),
    the session's references, and per class a trainer process holding v2."""

    backend: ClassVar[str]

    # -- fixtures -----------------------------------------------------------------------
    @pytest.fixture(scope="class")
    @classmethod
    def models(cls, model_pair):
        return model_pair

    @pytest.fixture(scope="class")
    @classmethod
    def plugin_env(cls, standin_env) -> dict[str, str]:
        """Extra environment of the engine server and the trainer process."""
        return standin_env

    @classmethod
    def trainer_env(cls, plugin_env: dict[str, str], engine: VLLMServer) -> dict[str, str]:
        """A trainer on the engine's chip (NPU IPC) or on one of its own (HCCL)."""
        colocated = cls.backend == "ascend_rl_npu_ipc"
        return {**plugin_env, **trainer_env(engine.chips, colocated=colocated)}

    @pytest.fixture(scope="class")
    @classmethod
    def engine(cls, rl_engines):
        return rl_engines(cls.backend)

    @pytest.fixture(scope="class")
    @classmethod
    def reference(cls, references_v2):
        return references_v2(cls.backend)

    @pytest.fixture(scope="class")
    @classmethod
    def v1_probe(cls, reference_v1):
        """Greedy output on the v1 weights."""
        return greedy_token_ids(reference_v1.url, PROBE, 24)

    @pytest.fixture(scope="class")
    @classmethod
    def trainer(cls, models, tmp_path_factory, plugin_env, engine, v1_probe, shared_servers):
        """The class's trainer; at the end it leaves the shared engine on v1 (or, if it cannot,
        has it stopped, to be started anew)."""
        log = tmp_path_factory.mktemp(f"{cls.backend}-trainer") / "trainer.log"
        env = cls.trainer_env(plugin_env, engine)
        with TrainerProcess(models[1], log_path=log, env=env) as t:
            yield t
            try:
                cls.put_on_v1(t, engine, models, v1_probe)
            except Exception as e:
                print(f"the shared engine could not be put back on v1 ({e}): it is stopped")
                shared_servers.discard(engine)

    @pytest.fixture
    def on_v1(self, engine, trainer, models, v1_probe):
        self.put_on_v1(trainer, engine, models, v1_probe)
        yield
        EngineControlClient(engine.url).resume()

    @classmethod
    def put_on_v1(cls, trainer, engine, models, v1_probe) -> None:
        """Resume the engine and sync v1 weights into it; the trainer keeps holding v2."""
        EngineControlClient(engine.url).resume()
        cls.init(trainer, engine)
        trainer.load(models[0])
        trainer.send(weight_version="v1")
        trainer.load(models[1])
        assert greedy_token_ids(engine.url, PROBE, 24) == v1_probe
        assert_addresses_kept(engine.url, "the syncs of the test before")

    @classmethod
    def init(cls, trainer: TrainerProcess, engine: VLLMServer, **kw) -> None:
        init_trainer(cls.backend, trainer, engine, **kw)

    @staticmethod
    def assert_alive_and_intact(engine: VLLMServer, v1_probe: list[int]) -> None:
        assert engine.is_healthy(), "server died"
        assert greedy_token_ids(engine.url, PROBE, 24) == v1_probe, "weights changed"
        assert_addresses_kept(engine.url, "the refused or failed update")


class WeightSyncCases(WeightSyncServers):
    # -- the seed's RL e2e -------------------------------------------------------------
    @pytest.mark.parametrize("wire", list(WIRES))
    def test_weight_swap_continues_on_new_weights(self, engine, reference, trainer, on_v1, wire):
        self.init(trainer, engine, **WIRES[wire])
        out = swap_mid_generation(engine.url, lambda: trainer.send(weight_version="v2"))
        assert not out.problems, out.problems
        assert all(k > 0 for k in out.split), out.split
        if wire == "small_bucket":
            assert out.sync_result["num_buckets"] > 2
        assert out.sync_result["bytes"] > 0
        assert check_continuations(reference.url, out) == [True] * len(out.streams)

    def test_an_unpaused_sync_lands_between_two_tokens_of_every_stream(
        self, engine, reference, trainer, on_v1
    ):
        """vLLM's API unchanged: ``send_weights`` on an engine that generates. The plugin
        scheduler runs no step while the update is open (a forward pass then would also cancel
        it, and this sync would fail), so each stream has the old weights' tokens, then exactly
        the new weights' greedy continuation from where it stood."""
        self.init(trainer, engine)
        out = swap_unpaused(engine.url, lambda: trainer.send(weight_version="v2", pause=False))
        assert not out.problems, out.problems
        assert out.sync_result["bytes"] > 0
        assert check_continuations(reference.url, out) == [True] * len(out.streams)
        assert_addresses_kept(engine.url, "an unpaused sync")

    # -- transactional updates ---------------------------------------------------------
    finish_fails_under: ClassVar[str]  # the on_failure mode a class tests a failed finish in

    def test_a_finish_that_fails_ends_the_update_as_on_failure_says(
        self, engine, reference, trainer, on_v1, v1_probe
    ):
        """Post-load processing raises in ``finish_weight_update`` (an attention layer's, as
        vLLM's can). ``restore``: exactly the old weights, serving. ``hold``: not whole, so
        ``/resume`` is refused with the reason. Either way the next finish (the worker still
        counts the update open) answers OK, nothing logs in a loop, and the next sync lands.
        Each transport's class takes one mode: the modes are the session's, not the link's."""
        on_failure = self.finish_fails_under
        self.init(trainer, engine, on_failure=on_failure)
        ctl = EngineControlClient(engine.url)
        log_before = len(engine.log_path.read_text(errors="replace"))
        ctl.collective_rpc("fail_next_finish")
        with pytest.raises(TrainerError, match="post-load processing failed: ValueError") as e:
            trainer.send(weight_version="v2")  # paused (keep); the resume after it is refused
        if on_failure == "restore":
            assert "model unchanged (the old weights were restored" in str(e.value)
            ctl.resume()
            self.assert_alive_and_intact(engine, v1_probe)
        else:
            assert ctl.is_paused() is True
            with pytest.raises(EngineControlError, match="the weights are not whole"):
                ctl.resume()
        r = requests.post(engine.url + "/finish_weight_update", json={}, timeout=60)
        assert r.status_code == 200, r.text  # the worker's record of the failed update ends
        trainer.send(weight_version="v2")
        ctl.resume()
        v2_probe = greedy_token_ids(reference.url, PROBE, 24)
        assert greedy_token_ids(engine.url, PROBE, 24) == v2_probe
        assert_addresses_kept(engine.url, "a failed finish and the sync after it")
        log = engine.log_path.read_text(errors="replace")[log_before:]
        assert log.count("no update is open here") == 1, "the retried finish said nothing"
        assert "ending a weight update nobody finished" not in log  # 6935d63: every 5 ms

    @pytest.mark.parametrize("case", list(BAD_METADATA))
    def test_bad_metadata_is_refused_and_model_untouched(
        self, engine, trainer, on_v1, v1_probe, case
    ):
        fault, message = BAD_METADATA[case]
        self.init(trainer, engine, validation="partial")  # part_of_a_layer: partial's own rule
        with pytest.raises(TrainerError, match="refused") as err:
            trainer.send(**fault)
        assert message in str(err.value)
        self.assert_alive_and_intact(engine, v1_probe)
        trainer.send(weight_version="v2")  # a refusal leaves the connection usable
        assert greedy_token_ids(engine.url, PROBE, 24) != v1_probe

    def test_metrics_count_each_update_by_result(self, engine, trainer, on_v1, v1_probe):
        """The engine's /metrics (the API server reads its workers' counters) and the
        trainer's registry: a sync adds its bytes and an ``ok``; a refused one adds a refusal
        with its cause and no bytes."""
        ours = {"side": "engine", "backend": self.backend}
        before = scrape(engine.url)
        self.init(trainer, engine)
        sync = trainer.send(weight_version="v2")
        after = scrape(engine.url)
        assert added(before, after, "weight_update_bytes", **ours) == sync["bytes"] > 0
        assert added(before, after, "weight_updates", **ours, result="ok", cause="") == 1
        assert added(before, after, "weight_update_load_seconds", **ours) > 0
        assert added(before, after, "weight_update_transport_seconds", **ours) > 0
        assert {labels["worker"] for labels in series(after, "weight_updates")} == {"0"}
        with pytest.raises(TrainerError, match="refused"):
            trainer.send(**BAD_METADATA["oversized_shape"][0])
        refused = scrape(engine.url)
        cause = {"result": "refused", "cause": "invalid_weights"}
        assert added(after, refused, "weight_updates", **ours, **cause) == 1
        assert added(after, refused, "weight_update_bytes", **ours) == 0
        trained = scrape_text(trainer.metrics())
        sent = {"side": "trainer", "backend": self.backend}
        assert added({}, trained, "weight_updates", **sent, result="ok", cause="") >= 1
        assert added({}, trained, "weight_updates", **sent, result="refused") >= 1
        assert added({}, trained, "weight_update_bytes", **sent) >= sync["bytes"]

    def test_partial_update_keeps_the_layers_it_leaves_out(
        self, engine, reference, models, trainer, on_v1, v1_probe, tmp_path
    ):
        """Frozen modules are not sent: they keep v1, the rest becomes v2, exactly what
        vLLM's own loader makes of a checkpoint mixed that way, once the trainer said so
        (validation='partial'); by default the same update is refused, weights intact."""
        self.init(trainer, engine)  # validation="complete", the default
        with pytest.raises(TrainerError, match=r"'model\.embed_tokens\.weight', .* is missing"):
            trainer.send(freeze=FROZEN)
        self.assert_alive_and_intact(engine, v1_probe)
        self.init(trainer, engine, validation="partial")
        result = trainer.send(weight_version="v2-partial", freeze=FROZEN)
        assert result["num_tensors"] < len(parameter_shapes(TinyModelSpec()))
        partial = greedy_token_ids(engine.url, PROBE, 24)
        assert partial not in (v1_probe, greedy_token_ids(reference.url, PROBE, 24))
        mixed = mixed_checkpoint(models[0], models[1], FROZEN, tmp_path / "mixed")
        EngineControlClient(engine.url).reload_weights(str(mixed))  # vLLM's own loader
        assert greedy_token_ids(engine.url, PROBE, 24) == partial

    def test_a_trainer_that_forgets_one_tensor_is_refused_by_default(
        self, engine, trainer, on_v1, v1_probe
    ):
        """A name mapping that drops one layer norm: the default refuses the update, naming
        it, instead of serving a model that is neither version."""
        self.init(trainer, engine)
        forgotten = "model.layers.1.post_attention_layernorm.weight"
        with pytest.raises(TrainerError, match=rf"{re.escape(repr(forgotten))} is missing") as e:
            trainer.send(weight_version="v2", freeze=[forgotten])
        assert "validation='partial'" in str(e.value)
        self.assert_alive_and_intact(engine, v1_probe)

    def test_weight_checker_tells_a_full_sync_from_a_wrong_one(
        self, engine, reference, trainer, on_v1
    ):
        """vLLM's /weight_checker on our workers: after a sync the digests equal a fresh
        engine's on the same weights; after a deliberately wrong sync (the embedding and layer
        1's MLP left on v1) the tensors left behind differ. vLLM's CPU linear layers drop their
        weight tensor once it is prepacked (layers/utils.py, remove_weight): their digest is
        that of no bytes, so on CPU only the embedding of those shows."""
        if not has_route("/weight_checker"):
            pytest.skip("this vLLM has no /weight_checker (0.32 and later)")
        ctl, fresh = EngineControlClient(engine.url), EngineControlClient(reference.url)
        v2 = fresh.weight_checksums()
        assert v2 and all(k.startswith("dp0:pp0:pcp0:tp0:") for k in v2)
        frozen = ["model.embed_tokens.", "model.layers.1.mlp."]
        self.init(trainer, engine, validation="partial")  # wrong on purpose
        trainer.send(weight_version="v2-wrong", freeze=frozen)
        visible = sorted(k for k in v2 if any(f in k for f in frozen) and v2[k] != NO_BYTES)
        assert "dp0:pp0:pcp0:tp0:model.embed_tokens.weight" in visible
        assert ctl.weight_mismatches(v2) == visible
        trainer.send(weight_version="v2")
        assert ctl.weight_mismatches(v2) == []
        assert ctl.weight_checksums() == v2

    def test_trainer_dying_mid_transfer(
        self, engine, reference, models, trainer, on_v1, v1_probe, tmp_path, plugin_env
    ):
        """The engine's update fails as soon as the trainer is gone, not after the exec
        timeout: the channel is aborted first and nothing waits on the device behind the dead
        trainer's collective (N3; the CPU stand-in holds it queued for the exec timeout, as
        HCCL does, so a device-wide sync on the failure path would wait ``timeout_s``)."""
        timeout_s = 30
        env = self.trainer_env(plugin_env, engine)
        segments_before = staging_segments()
        counted = scrape(engine.url)
        checker = has_route("/weight_checker")  # vLLM 0.30 has none
        checksums = EngineControlClient(engine.url).weight_checksums() if checker else None
        trainer.release(engine.url)  # the channel's owner lets another trainer in
        with TrainerProcess(models[1], log_path=tmp_path / "dying.log", env=env) as doomed:
            self.init(doomed, engine, packed_buffer_size_bytes=SMALL_BUCKET, timeout_s=timeout_s)
            t0 = time.monotonic()
            with pytest.raises(TrainerError, match="exited"):
                doomed.send(die_after_tensors=8)  # layer 0: its q, k, v in part
        # NPU IPC: the dead trainer's staging segments leave /dev/shm (its resource tracker
        # unlinks them; the engine dropped its mappings); its doorbell is an abstract socket.
        while staging_segments() - segments_before and time.monotonic() < t0 + 30:
            time.sleep(0.2)
        assert not staging_segments() - segments_before, "a dead trainer's segments remain"
        # The engine's update fails long before the exec timeout, with a message, and the
        # engine keeps serving. (A failure path that synchronizes the device waits it out.)
        while "weight transfer failed" not in engine.log_path.read_text(errors="replace"):
            assert time.monotonic() < t0 + 2 * timeout_s, "the engine never reported it"
            time.sleep(0.5)
        failed_after = time.monotonic() - t0
        assert failed_after < timeout_s / 2, f"failed after {failed_after:.0f}s: it waited"
        print(f"\nthe engine reported the dead trainer {failed_after:.1f} s into the send")
        # The layers loaded before the crash were restored: the engine serves exactly v1, and
        # every tensor the checker reads (on CPU: embeddings, norms, biases, the head) is v1's,
        # the fused q/k/v bias the partial layer took in part included.
        self.assert_alive_and_intact(engine, v1_probe)
        assert not checker or EngineControlClient(engine.url).weight_checksums() == checksums
        failed = scrape(engine.url)
        ours = {"side": "engine", "backend": self.backend}
        assert added(counted, failed, "weight_updates", **ours, result="failed") == 1
        assert added(counted, failed, "weight_updates", cause="transfer") == 1
        assert added(counted, failed, "weight_restore_bytes", backend=self.backend) > 0
        self.init(trainer, engine)  # a new init works, and a full sync restores v2 exactly
        trainer.send(weight_version="v2")
        assert greedy_token_ids(engine.url, PROBE, 24) == greedy_token_ids(reference.url, PROBE, 24)

    def test_stalled_trainer_times_out_on_both_sides(
        self, engine, reference, trainer, on_v1, v1_probe
    ):
        timeout_s, stall_s = 5, 9
        self.init(trainer, engine, packed_buffer_size_bytes=SMALL_BUCKET, timeout_s=timeout_s)
        t0 = time.monotonic()
        with pytest.raises(TrainerError, match=f"within timeout_s={timeout_s}s"):
            trainer.send(stall_after_tensors=12, stall_s=stall_s)  # the engine's message
        assert time.monotonic() - t0 < stall_s + 2 * timeout_s + 10
        self.assert_alive_and_intact(engine, v1_probe)
        self.init(trainer, engine)
        trainer.send(weight_version="v2")
        assert greedy_token_ids(engine.url, PROBE, 24) == greedy_token_ids(reference.url, PROBE, 24)

    def test_an_update_no_trainer_joins_is_refused_within_timeout_and_loses_nothing(
        self, engine, reference, trainer, on_v1, v1_probe
    ):
        """An update_weights in the owner's name with no trainer behind it, refused for the
        model alone: refused within timeout_s (HCCL waits that long for a trainer in the
        handshake; NPU IPC refuses at once), the model untouched; the connection must be made
        again (its handshake is out of step), and then a sync lands exactly."""
        timeout_s = 3
        ctl = EngineControlClient(engine.url)
        ctl.pause(mode="abort")
        self.init(trainer, engine, timeout_s=timeout_s)
        owner = trainer.request("ping")["trainer_id"]
        bad = {"names": [UNKNOWN], "dtype_names": ["bfloat16"], "shapes": [[128]]}
        bad["trainer_id"] = owner
        assert requests.post(engine.url + "/start_weight_update", timeout=60).ok
        t0 = time.monotonic()
        r = requests.post(engine.url + "/update_weights", json={"update_info": bad}, timeout=120)
        elapsed = time.monotonic() - t0
        assert r.status_code >= 400 and f"unknown parameter '{UNKNOWN}'" in r.text, r.text
        assert elapsed < timeout_s + 10, f"refused after {elapsed:.1f}s (timeout_s={timeout_s})"
        ctl.resume()
        self.assert_alive_and_intact(engine, v1_probe)
        self.init(trainer, engine)
        trainer.send(weight_version="v2")
        assert greedy_token_ids(engine.url, PROBE, 24) == greedy_token_ids(reference.url, PROBE, 24)

    def test_trainer_killed_during_init_frees_the_channel_within_its_timeout(
        self, engine, reference, models, trainer, on_v1, v1_probe, tmp_path, plugin_env
    ):
        """A trainer crashes after the engine workers joined its init (HCCL: after the
        rendezvous; NPU IPC: at the workers' hello). The engine serves requests meanwhile, the
        failed init frees the channel within timeout_s, and the next trainer's init works."""
        timeout_s = 10
        env = self.trainer_env(plugin_env, engine)
        trainer.release(engine.url)
        with TrainerProcess(models[1], log_path=tmp_path / "doomed.log", env=env) as doomed:
            t0 = time.monotonic()
            with pytest.raises(TrainerError, match="exited"):
                self.init(doomed, engine, timeout_s=timeout_s, die_during_init=True)
            assert greedy_token_ids(engine.url, PROBE, 24) == v1_probe
        while "init failed" not in (refusal := start_refusal(engine.url)):
            assert time.monotonic() < t0 + timeout_s + 15, f"channel still held: {refusal}"
            time.sleep(0.2)
        self.init(trainer, engine)
        trainer.send(weight_version="v2")
        assert greedy_token_ids(engine.url, PROBE, 24) == greedy_token_ids(reference.url, PROBE, 24)
