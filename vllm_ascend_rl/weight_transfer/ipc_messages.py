"""The NPU-IPC doorbell's messages between a trainer rank and its chip's engine workers, one
JSON line each, tagged by ``kind`` (the protocol: ``npu_ipc_trainer.py``). ``id`` is the
update's id, or the bucket's index in ``bucket`` and ``done``; ``reason`` says why a side
refused or gave up (None: it did not)."""

from __future__ import annotations

from typing import Annotated, Literal, TypeAlias

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from vllm_ascend_rl.weight_transfer.wire import WIRE_CONFIG, Verdict


class _Strict(BaseModel):
    model_config = ConfigDict(**WIRE_CONFIG, frozen=True)


class Hello(_Strict):  # engine worker -> its chip's rank, on connecting
    kind: Literal["hello"] = "hello"
    worker: int
    wire: int  # wire_signature
    location: dict[str, str]
    step_hold: int  # readiness.StepHold


class Welcome(_Strict):  # rank -> worker: the answer to its hello
    kind: Literal["welcome"] = "welcome"
    reason: str | None = None


class Ready(_Strict):  # worker -> its rank: its verdict
    kind: Literal["ready"] = "ready"
    id: int
    verdict: Verdict
    reason: str | None = None
    plan: int | None = None  # a worker's plan_signature


class Go(_Strict):  # rank -> its workers: every worker's lowest verdict
    kind: Literal["go"] = "go"
    id: int
    verdict: Verdict
    reason: str | None = None


class Filled(_Strict):  # rank -> its workers: a piece of the bucket is in the ring's next slot
    kind: Literal["bucket"] = "bucket"
    id: int


class Done(_Strict):  # worker -> its rank: it took that piece out; the slot is free
    kind: Literal["done"] = "done"
    id: int


class Abort(_Strict):  # rank -> its workers: it gives up the connection
    kind: Literal["abort"] = "abort"
    reason: str


Message: TypeAlias = Hello | Welcome | Ready | Go | Filled | Done | Abort
MESSAGE: TypeAdapter[Message] = TypeAdapter(Annotated[Message, Field(discriminator="kind")])
