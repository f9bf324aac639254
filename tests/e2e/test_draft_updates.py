"""Speculative decoding through RL: the drafter's weights updated with the target's guarantees.

One engine per transport serves a tiny target with a draft model (``--speculative-config``,
method ``draft_model``). The target is a two-layer checkpoint whose second layer is muted, the
drafter a one-layer model of the same weights (``tiny_model.spec_decode_pair``): on a fresh
engine the drafter predicts exactly the target's next token, and its checkpoint is not the
target's. The trainer holds both on v2 and sends them as an RL step does: the target, then the
drafter, each a session of its own (``send_weights(..., draft=True)``). HCCL's engine runs
vLLM's CPU worker on an emulated chip (vLLM's ``/start_draft_weight_update``, which resets the
engine's target itself); NPU IPC's the sleepable stand-in worker with ``NPUWorker``'s lifecycle,
which has no draft route of its own (the plugin's, ``SleepableMixin.start_draft_weight_update``).
Acceptance is read from vLLM's spec-decode counters on ``/metrics``; greedy output, which the
target alone decides, is checked against the same engine reloading the target from disk.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import ClassVar

import pytest

from tests.support import StreamingCompletion, VLLMServer, free_port, greedy_token_ids
from tests.support.profile import trainer_env
from tests.support.spec_decode import PROMPTS, acceptance, draft_server, drafter_checksums, models
from tests.support.trainer import TrainerError, TrainerProcess
from vllm_ascend_rl.client import EngineControlClient
from vllm_ascend_rl.worker.ledger import moved

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

PROBE = "Draft and target:"


def draft_engine(backend: str, sleepable: bool):
    def make(log_dir: Path) -> list[VLLMServer]:
        return [draft_server(backend, log_dir / f"draft-{backend}.log", sleepable=sleepable)]

    make.__name__ = f"draft_engine_{backend}"
    return make


ENGINES = {
    "ascend_rl_hccl": draft_engine("ascend_rl_hccl", sleepable=False),
    "ascend_rl_npu_ipc": draft_engine("ascend_rl_npu_ipc", sleepable=True),
}
SERVERS = tuple(ENGINES.values())


def accepted(url: str) -> float:
    return acceptance(url)[0]


def addresses(url: str) -> dict[str, int]:
    """The engine's address ledger now, the drafter's tensors (``draft.``) included."""
    ledger = EngineControlClient(url).collective_rpc("address_ledger")[0][0]
    assert any(name.startswith("parameter:draft.") for name in ledger), "no drafter in the ledger"
    return ledger


def assert_kept_since(url: str, since: dict[str, int], after: str) -> None:
    """Nothing moved since the ledger ``since`` (the test's start: vLLM's own disk reload, the
    HCCL engine's reference, gives the attention layers new scale tensors)."""
    gone = moved(since, addresses(url))
    assert not gone, (
        f"after {after}: {len(gone)} tensor(s) moved, e.g. {dict(list(gone.items())[:4])}"
    )


class DraftUpdateCases:
    backend: ClassVar[str]

    @pytest.fixture(scope="class")
    @classmethod
    def engine(cls, server_plan):
        with server_plan.serving(ENGINES[cls.backend]) as (srv,):
            yield srv

    @pytest.fixture(scope="class")
    @classmethod
    def fresh(cls, engine):
        """The fresh engine's acceptance, and greedy probes on the target's v1 and (reloaded
        from disk, as a fresh engine on them holds) v2 weights."""
        (target_v1, _), (target_v2, _) = models()
        ctl = EngineControlClient(engine.url, timeout_s=300)
        figures = {
            "acceptance": accepted(engine.url),
            "v1": greedy_token_ids(engine.url, PROBE, 24),
        }
        ctl.reload_weights(str(target_v2))
        figures["v2"] = greedy_token_ids(engine.url, PROBE, 24)
        ctl.reload_weights(str(target_v1))
        assert figures["v2"] != figures["v1"]
        return figures

    @pytest.fixture(scope="class")
    @classmethod
    def trainer(cls, engine, fresh, tmp_path_factory):
        """A trainer holding the target and the drafter on v2."""
        (_, _), (target_v2, drafter_v2) = models()
        log = tmp_path_factory.mktemp(f"draft-{cls.backend}") / "trainer.log"
        env = trainer_env(engine.chips, colocated=cls.backend == "ascend_rl_npu_ipc")
        with TrainerProcess(target_v2, log_path=log, env=env) as t:
            t.load_draft(drafter_v2)
            yield t

    def init(self, trainer: TrainerProcess, engine: VLLMServer, **kw) -> None:
        kw.setdefault("timeout_s", 30)
        if self.backend == "ascend_rl_hccl":
            kw.update(world_size=2, master_address="127.0.0.1", master_port=free_port())
        trainer.init(self.backend, engine.url, **kw)

    @pytest.fixture
    def on_v1(self, engine, trainer, fresh):
        """Both models on v1 (the trainer keeps holding v2), the engine resumed."""
        (target_v1, drafter_v1), (target_v2, drafter_v2) = models()
        EngineControlClient(engine.url).resume()
        self.init(trainer, engine)
        trainer.load(target_v1)
        trainer.load_draft(drafter_v1)
        trainer.send(weight_version="v1")
        trainer.send(weight_version="v1", draft=True)
        trainer.load(target_v2)
        trainer.load_draft(drafter_v2)
        assert greedy_token_ids(engine.url, PROBE, 24) == fresh["v1"]
        yield addresses(engine.url)
        EngineControlClient(engine.url).resume()

    def test_acceptance_falls_after_a_target_update_and_returns_with_the_drafters(
        self, engine, trainer, fresh, on_v1, report
    ):
        """What an RL loop sees: the target alone on v2 leaves a drafter that no longer
        predicts it; the drafter's update, a session of its own, brings acceptance back. Greedy
        output is the v2 target's each time, and nothing moved in memory."""
        trainer.send(weight_version="v2")
        target_only = accepted(engine.url)
        assert greedy_token_ids(engine.url, PROBE, 24) == fresh["v2"]
        sent = trainer.send(weight_version="v2", draft=True)
        assert sent["bytes"] > 0 and sent["num_tensors"] == 15  # the one-layer drafter's
        both = accepted(engine.url)
        assert greedy_token_ids(engine.url, PROBE, 24) == fresh["v2"]
        report(
            f"draft updates ({self.backend}): acceptance fresh {fresh['acceptance']:.3f}, "
            f"target-only {target_only:.3f}, target + drafter {both:.3f}"
        )
        assert fresh["acceptance"] > 0.8 and both > 0.8, (fresh["acceptance"], both)
        assert target_only < fresh["acceptance"] / 2, (target_only, fresh["acceptance"])
        assert_kept_since(engine.url, on_v1, "a target update and a drafter update")

    def test_an_unpaused_draft_update_lands_between_two_tokens(self, engine, trainer, on_v1):
        """No pause: the step gate holds the steps (the drafter runs in every one) while the
        drafter's update is open; every stream goes on with the target's exact tokens, now
        drafted by the new drafter."""
        trainer.send(weight_version="v2")
        before = accepted(engine.url)
        expected = [greedy_token_ids(engine.url, prompt, 200) for prompt in PROMPTS]
        streams = [StreamingCompletion(engine.url, prompt, 200) for prompt in PROMPTS]
        for s in streams:
            s.start()
        deadline = time.monotonic() + 60
        while min(s.num_tokens for s in streams) < 8 and time.monotonic() < deadline:
            time.sleep(0.002)
        sent = trainer.send(weight_version="v2", draft=True, pause=False)
        midway = [s.num_tokens for s in streams]
        for s in streams:
            s.join(120)
        assert sent["bytes"] > 0 and min(midway) < 200, midway  # it landed mid-generation
        assert [s.token_ids for s in streams] == expected
        assert all(s.ok and s.finish_reason == "length" for s in streams)
        assert accepted(engine.url) > max(0.8, 2 * before)
        assert_kept_since(engine.url, on_v1, "an unpaused drafter update")

    def test_a_draft_update_that_fails_mid_transfer_restores_the_drafter_exactly(
        self, engine, trainer, fresh, on_v1, tmp_path
    ):
        """The trainer dies after a few of the drafter's tensors: the engine restores the
        drafter's old weights (checksum), serves on, and its drafts are accepted as before."""
        checksum = drafter_checksums(engine.url)
        log_before = len(engine.log_path.read_text(errors="replace"))
        (_, _), (target_v2, drafter_v2) = models()
        trainer.release(engine.url)
        env = trainer_env(engine.chips, colocated=self.backend == "ascend_rl_npu_ipc")
        with TrainerProcess(target_v2, log_path=tmp_path / "dying.log", env=env) as doomed:
            doomed.load_draft(drafter_v2)
            self.init(doomed, engine, packed_buffer_size_bytes=64 << 10)  # a bucket at a time
            with pytest.raises(TrainerError, match="exited"):
                doomed.send(draft=True, die_after_tensors=8)
        deadline = time.monotonic() + 60
        while (
            "weight transfer failed" not in engine.log_path.read_text(errors="replace")[log_before:]
        ):
            assert time.monotonic() < deadline, "the engine never reported the dead trainer"
            time.sleep(0.5)
        EngineControlClient(engine.url).resume()
        assert drafter_checksums(engine.url) == checksum
        assert greedy_token_ids(engine.url, PROBE, 24) == fresh["v1"]
        assert accepted(engine.url) > 0.8
        assert_kept_since(engine.url, on_v1, "a drafter update that failed mid-transfer")

    def test_a_draft_update_is_checked_against_the_drafters_checkpoint(
        self, engine, trainer, fresh, on_v1
    ):
        """The target's weights sent as the drafter's are refused (the drafter has no second
        layer), as is a grown tensor, each naming the tensor; nothing loaded."""
        checksum = drafter_checksums(engine.url)
        (_, _), (target_v2, drafter_v2) = models()
        trainer.load_draft(target_v2)
        try:
            with pytest.raises(TrainerError, match=r"unknown parameter 'model\.layers\.1\."):
                trainer.send(draft=True)
        finally:
            trainer.load_draft(drafter_v2)
        grown = "model.layers.0.mlp.gate_proj.weight"
        with pytest.raises(TrainerError, match=f"'{grown}': shape \\[320, 128\\]"):
            trainer.send(draft=True, grow=grown)
        assert drafter_checksums(engine.url) == checksum
        assert greedy_token_ids(engine.url, PROBE, 24) == fresh["v1"]
        assert accepted(engine.url) > 0.8
        trainer.send(weight_version="v2", draft=True)  # the channel is still usable
        assert drafter_checksums(engine.url) != checksum


class TestHCCLDraftUpdates(DraftUpdateCases):
    backend = "ascend_rl_hccl"


class TestNPUIPCDraftUpdates(DraftUpdateCases):
    backend = "ascend_rl_npu_ipc"
