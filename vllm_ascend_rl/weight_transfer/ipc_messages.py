"""The NPU-IPC doorbell's messages, one JSON line each, tagged by ``kind`` (the protocol:
``npu_ipc_trainer.py``). ``id`` is the update's id, or the bucket's index in ``bucket`` and
``done``; ``reason`` says why a side refused or gave up (None: it did not)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeAlias

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


class Welcome(_Strict):  # rank -> worker, or sender -> another rank: the answer to its hello
    kind: Literal["welcome"] = "welcome"
    reason: str | None = None


class Peer(_Strict):  # another rank -> the sender, on connecting
    kind: Literal["peer"] = "peer"
    rank: int


class Init(_Strict):  # sender -> the other ranks: the engine's init returned
    kind: Literal["init"] = "init"
    reason: str | None = None


class Workers(_Strict):  # another rank -> the sender: the engine workers it welcomed
    kind: Literal["workers"] = "workers"
    count: int
    step_hold: int  # the lowest of theirs (readiness.StepHold)


class Update(_Strict):  # sender -> the other ranks: an update begins
    kind: Literal["update"] = "update"
    id: int


class Ring(_Strict):  # another rank -> the sender: its ring's handles
    kind: Literal["ring"] = "ring"
    id: int
    chip: str
    handles: list[dict[str, Any]]


class Ready(_Strict):  # worker -> its rank, another rank -> the sender: its (workers') verdict
    kind: Literal["ready"] = "ready"
    id: int
    verdict: Verdict
    reason: str | None = None
    plan: int | None = None  # a worker's plan_signature


class Go(_Strict):  # sender -> the other ranks, each rank -> its workers: the lowest verdict
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


class Sent(_Strict):  # another rank -> the sender: it streamed the update to its workers
    kind: Literal["sent"] = "sent"
    id: int


class Cancel(_Strict):  # sender -> the other ranks: the update ends before any worker saw it
    kind: Literal["cancel"] = "cancel"
    id: int
    reason: str


class Abort(_Strict):  # a trainer rank -> all it talks to: it gives up the connection
    kind: Literal["abort"] = "abort"
    reason: str


_Connecting: TypeAlias = Hello | Welcome | Peer | Init | Workers
_Updating: TypeAlias = Update | Ring | Ready | Go | Filled | Done | Sent | Cancel | Abort
Message: TypeAlias = _Connecting | _Updating
MESSAGE: TypeAdapter[Message] = TypeAdapter(Annotated[Message, Field(discriminator="kind")])
