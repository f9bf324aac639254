"""The wire parameters: one typed definition, signed whole at init (timeout_s included), and
the bucket plan signed at every update. A mismatch of either is refused before any byte moves:
real engine and trainer code over a gloo group, in threads."""

from __future__ import annotations

import threading
import time
import types

import pytest
import torch
from pydantic import ValidationError

from tests.support.stand_in_config import engine_config
from tests.unit.test_channel import run_ranks
from tests.unit.test_ipc_transport import doorbell_pair
from vllm_ascend_rl.device import get_device
from vllm_ascend_rl.weight_transfer.buckets import TensorSpec
from vllm_ascend_rl.weight_transfer.connection import ConnState
from vllm_ascend_rl.weight_transfer.hccl import (
    DIRECT_BYTES,
    AscendRLHCCLWeightTransferEngine,
    AscendRLHCCLWeightTransferInitInfo,
    HCCLLink,
    HCCLTrainerInitInfo,
)
from vllm_ascend_rl.weight_transfer.hccl_trainer import AscendRLHCCLTrainerWeightTransferEngine
from vllm_ascend_rl.weight_transfer.npu_ipc import (
    AscendRLNPUIPCWeightTransferInitInfo,
    AscendRLNPUIPCWeightTransferUpdateInfo,
    IPCLink,
    NPUIPCTrainerInitInfo,
)
from vllm_ascend_rl.weight_transfer.npu_ipc_trainer import (
    AscendRLNPUIPCTrainerWeightTransferEngine,
)
from vllm_ascend_rl.weight_transfer.trainer_side import WeightSyncError
from vllm_ascend_rl.weight_transfer.validation import WeightUpdateRefused
from vllm_ascend_rl.weight_transfer.wire import (
    WIRE_FIELDS,
    Verdict,
    WireParams,
    plan_for,
    wire_params,
    wire_signature,
)

INFOS = [
    HCCLTrainerInitInfo,
    AscendRLHCCLWeightTransferInitInfo,
    NPUIPCTrainerInitInfo,
    AscendRLNPUIPCWeightTransferInitInfo,
]


@pytest.mark.parametrize("cls", INFOS, ids=lambda c: c.__name__)
def test_every_init_info_embeds_the_one_wire_definition(cls):
    assert issubclass(cls, WireParams)
    names = [f for f in cls.__dataclass_fields__ if f in WIRE_FIELDS]
    assert names == list(WIRE_FIELDS)


@pytest.mark.parametrize(
    "field, value",
    [
        ("timeout_s", "5"),
        ("timeout_s", float("nan")),
        ("timeout_s", 0),
        ("packed", 1),
        ("packed_buffer_size_bytes", -1),
        ("packed_num_buffers", 0),
        ("on_failure", "ignore"),
        ("validation", "most"),
    ],
)
def test_a_bad_wire_parameter_is_refused_naming_it(field, value):
    with pytest.raises(ValidationError, match=field):
        HCCLTrainerInitInfo(
            rank=0, master_address="h", master_port=1, world_size=2, **{field: value}
        )


@pytest.mark.parametrize("field, other", [("timeout_s", 61.0), ("packed_num_buffers", 3)])
def test_the_signature_covers_every_wire_parameter(field, other):
    a = HCCLTrainerInitInfo(rank=0, master_address="h", master_port=1, world_size=2)
    b = HCCLTrainerInitInfo(**{**vars(a), field: other})
    assert wire_signature(a, DIRECT_BYTES) != wire_signature(b, DIRECT_BYTES)
    assert wire_signature(a, DIRECT_BYTES) != wire_signature(a, None)  # the plan's constants


def _engine() -> AscendRLHCCLWeightTransferEngine:
    from vllm_ascend_rl.core.recompute_scheduler import RecomputeScheduler

    scheduler = types.SimpleNamespace(get_scheduler_cls=lambda: RecomputeScheduler)
    config = engine_config(scheduler_config=scheduler)
    return AscendRLHCCLWeightTransferEngine(
        None, config, torch.device("cpu"), torch.nn.Linear(2, 2)
    )


def test_an_init_whose_timeout_differs_is_refused_at_the_handshake(monkeypatch):
    """The engine's real init against a trainer rank that signed timeout_s=60: the init
    returns at once, the handshake refuses on the owner's thread, the next call says why, and
    neither side broadcast anything."""
    trainer_info = HCCLTrainerInitInfo(rank=0, master_address="h", master_port=1, world_size=2)
    seen: dict = {}

    def body(ch):
        if ch.rank == 0:
            _, same = ch.agree(Verdict.GO, wire_signature(trainer_info, DIRECT_BYTES), "init")
            return same
        engine = _engine()
        engine_info = AscendRLHCCLWeightTransferInitInfo(
            master_address="127.0.0.1",
            master_port=1,
            world_size=2,
            **{**wire_params(trainer_info), "timeout_s": 61.0},
        )
        monkeypatch.setattr(
            "vllm_ascend_rl.weight_transfer.hccl.BroadcastChannel.open", lambda *a, **k: ch
        )
        engine.init_transfer_engine(engine_info)
        deadline = time.monotonic() + 30
        while engine.connection.state is ConnState.CONNECTING and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(RuntimeError, match="disagree on the weight-transfer protocol"):
            engine.connection.link()
        seen["state"] = engine.connection.state
        return ch.broken

    same, broken = run_ranks(2, body)
    assert same is False and seen["state"] is ConnState.FAILED and broken == "closed"


def test_an_update_whose_plan_differs_is_refused_before_any_byte():
    """Trainer and engine plan the same tensors into different buckets (here: the engine
    sends large tensors alone, the trainer does not): the handshake refuses on both sides."""
    specs = [TensorSpec("a", torch.float32, (1000,)), TensorSpec("b", torch.float32, (4 << 20,))]
    info = AscendRLHCCLWeightTransferInitInfo(
        master_address="127.0.0.1", master_port=1, world_size=2
    )
    update = types.SimpleNamespace(raise_if_failed=lambda: None)

    def body(ch):
        if ch.rank == 0:
            trainer = object.__new__(AscendRLHCCLTrainerWeightTransferEngine)
            trainer.channel = ch
            return trainer.agree(plan_for(info, specs, None), update), ch.broken
        link = HCCLLink(ch, info, _engine().session.pool)
        plan = plan_for(info, specs, DIRECT_BYTES)
        with pytest.raises(WeightUpdateRefused, match="plan differs"):
            link.agree(Verdict.GO, None, plan)
        return ch.broken

    (verdict, trainer_broken), engine_broken = run_ranks(2, body)
    assert verdict is Verdict.REFUSED and trainer_broken is None and engine_broken is None


def test_an_npu_ipc_worker_whose_plan_differs_is_refused_at_once_and_keeps_its_doorbell():
    """A worker that says GO with other buckets than its trainer rank's: the rank refuses the
    update and tells that worker so at once (it waits for a verdict), and the doorbell stays
    up for the next update. Real trainer and engine code over shared memory and a doorbell."""
    specs = [TensorSpec("a", torch.float32, (1000,)), TensorSpec("b", torch.float32, (3000,))]
    trainer = object.__new__(AscendRLNPUIPCTrainerWeightTransferEngine)
    trainer.init_info = NPUIPCTrainerInitInfo(rank=0, packed_buffer_size_bytes=16384)
    listener, trainer_end, engine_end = doorbell_pair(5.0)
    trainer.hw, trainer.ring, trainer.group, trainer.update_id = get_device("cpu"), [], None, 1
    trainer.is_sender, trainer.connected = True, True
    trainer.doorbells = [trainer_end]
    info = AscendRLNPUIPCWeightTransferInitInfo(
        doorbells={"chip": listener.address}, packed_buffer_size_bytes=16384
    )
    link = IPCLink(engine_end, info, get_device("cpu"), _engine().session)
    plan = plan_for(trainer.init_info, specs, None)  # one bucket of both tensors
    other = plan_for(
        AscendRLNPUIPCWeightTransferInitInfo(**{**vars(info), "packed_buffer_size_bytes": 12288}),
        specs,
        None,
    )
    assert len(other) != len(plan)
    update = AscendRLNPUIPCWeightTransferUpdateInfo(
        **AscendRLNPUIPCWeightTransferUpdateInfo.fields_from_specs(specs),
        buffers={trainer.hw.location()["chip"]: trainer._ring_handles(plan)},
        update_id=1,
    )
    verdicts: list[Verdict] = []
    rank = threading.Thread(
        target=lambda: verdicts.append(
            trainer.agree(plan, types.SimpleNamespace(raise_if_failed=lambda: None))
        )
    )
    rank.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(WeightUpdateRefused, match="the worker planned other buckets"):
            link.agree(Verdict.GO, None, other, update)
        waited = time.monotonic() - t0
        rank.join(10)
        assert verdicts == [Verdict.REFUSED]
        assert waited < 5.0, f"the worker waited {waited:.1f}s: its doorbell's timeout"
        assert link.peer_gone() is None and trainer.not_ready() is None
    finally:
        link.close()
        trainer.shutdown()
        listener.close()


@pytest.mark.parametrize("zero_copy", [True, False])
def test_the_trainers_init_choices_reach_the_engines_init_info(zero_copy):
    """What ``trainer_init`` is given for the engine (wire parameters, ``zero_copy``) is in
    the init info the trainer sends to ``/init_weight_transfer_engine``."""
    sent: list[dict] = []

    class Client:  # stands in for vLLM's client; the engine refuses, ending the init
        def init_weight_transfer_engine(self, init_info: dict) -> None:
            sent.append(init_info)
            raise RuntimeError("refused by the test")

    info = NPUIPCTrainerInitInfo(rank=0, zero_copy=zero_copy, timeout_s=7, packed=False)
    with pytest.raises(WeightSyncError, match="refused by the test"):
        AscendRLNPUIPCTrainerWeightTransferEngine.trainer_init(
            info, client=Client(), source=types.SimpleNamespace()
        )
    (engine_info,) = sent
    assert engine_info["zero_copy"] is zero_copy
    assert (engine_info["timeout_s"], engine_info["packed"]) == (7, False)


def test_the_update_hooks_run_in_the_engines_vllm_config(monkeypatch):
    """vLLM's workers call the engine's update hooks inside ``set_current_vllm_config``,
    vllm-ascend's ``NPUWorker`` outside it (worker.py:297-336 at 182b75e), where
    ``get_current_vllm_config()`` raises: the engine sets it itself, so what runs inside (a
    model's ``load_weights``, a layer's post-load processing) reads it on NPU too. Each hook
    is called here as NPUWorker calls it; what it runs records the config it sees."""
    from vllm.config import get_current_vllm_config

    engine, seen = _engine(), []

    def record(*_args, **_kwargs):
        seen.append(get_current_vllm_config())

    monkeypatch.setattr(engine.connection, "link", record)
    for step in ("start", "finish", "cancel"):
        monkeypatch.setattr(engine.session, step, record)
    monkeypatch.setattr(engine, "parse_update_info", lambda info: info)
    monkeypatch.setattr(engine, "receive_weights", record)
    monkeypatch.setattr(engine.connection, "close", record)
    # No accelerator here: a no-op, as vLLM's CPU model runner makes it (cpu_model_runner.py:178).
    monkeypatch.setattr("torch.accelerator.synchronize", lambda *_: None)
    engine.start_weight_update()
    engine.update_weights({})
    engine.finish_weight_update()
    engine.shutdown()
    assert seen and all(config is engine.vllm_config for config in seen), seen
