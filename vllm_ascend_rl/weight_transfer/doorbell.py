"""Host-local signalling between a colocated trainer and its engine workers: "bucket i is in
buffer k" and "bucket i was copied out" (the weights travel through shared staging buffers).
One JSON line per message, tagged by ``kind`` (the protocol: ``npu_ipc_trainer.py``), on a Unix
stream socket in Linux's abstract namespace (no file to clean up); a dead peer shows at once as
end-of-stream, a silent one after ``timeout_s``. A message's ``id`` is the update's id, or the
bucket's index in ``bucket`` and ``done``; ``reason`` says why a side refused or gave up (None:
it did not)."""

from __future__ import annotations

import secrets
import select
import socket
import time
from collections.abc import Callable
from contextlib import suppress
from typing import Annotated, Literal, NoReturn, TypeAlias, TypeVar

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from vllm_ascend_rl.weight_transfer import TransportError
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


Poll = Callable[[], None]
M = TypeVar("M", bound=Message)


class DoorbellError(TransportError):
    """The peer went away, stayed silent past the deadline, or sent something unexpected."""


class Doorbell:
    """One end of a trainer <-> engine-worker connection."""

    def __init__(self, sock: socket.socket, timeout_s: float, peer: str) -> None:
        self.sock, self.timeout_s, self.peer = sock, timeout_s, peer
        self._buf = b""
        self.broken: str | None = None

    @classmethod
    def connect(cls, address: str, timeout_s: float) -> Doorbell:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect("\0" + address)
        except OSError as e:
            sock.close()
            raise DoorbellError(
                f"cannot reach the trainer's doorbell {address!r}: {e}. "
                "Trainer and engine must run on the same host."
            ) from e
        return cls(sock, timeout_s, "trainer")

    def send(self, msg: Message) -> None:
        try:
            self.sock.sendall(msg.model_dump_json().encode() + b"\n")
        except OSError as e:
            self._break(f"send to {self.peer} failed: {e}")

    def recv(self, what: str, poll: Poll | None = None) -> Message:
        """The next message, within ``timeout_s``; ``poll`` runs while waiting. A malformed
        message or an :class:`Abort` breaks the doorbell."""
        deadline = time.monotonic() + self.timeout_s
        while b"\n" not in self._buf:
            if self.broken:
                raise DoorbellError(self.broken)
            if poll is not None and not self._readable(0):
                try:
                    poll()
                except Exception:
                    # What arrived wins over the poll: a worker's refusal, sent before its
                    # update call fails, can land between the check above and the poll.
                    if not self._readable(0):
                        raise
            left = deadline - time.monotonic()
            if not self._readable(max(0.0, min(left, 0.05))):
                if left <= 0:
                    self._break(
                        f"{what}: no message from the {self.peer} within "
                        f"timeout_s={self.timeout_s:.0f}s"
                    )
                continue
            try:
                chunk = self.sock.recv(1 << 16)
            except OSError as e:
                self._break(f"{what}: connection to the {self.peer} failed: {e}")
            if not chunk:
                self._break(f"{what}: the {self.peer} closed the connection (did it exit?)")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            msg = MESSAGE.validate_json(line)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, p['loc']))}: {p['msg']}" for p in e.errors())
            self._break(
                f"{what}: malformed message from the {self.peer} ({problems}): {line[:200]!r}"
            )
        if isinstance(msg, Abort):
            self._break(f"{what}: the {self.peer} aborted: {msg.reason}")
        return msg

    def _readable(self, wait_s: float) -> bool:
        return bool(select.select([self.sock], [], [], wait_s)[0])

    def expect(self, kind: type[M], id: int | None, what: str, poll: Poll | None = None) -> M:
        """The next message, which must be a ``kind`` (of update or bucket ``id``, if given)."""
        msg = self.recv(what, poll)
        if not isinstance(msg, kind) or (id is not None and getattr(msg, "id", None) != id):
            want = kind.__name__ if id is None else f"{kind.__name__}(id={id})"
            self._break(f"{what}: expected {want} from the {self.peer}, got {msg!r}")
        return msg

    def peer_gone(self) -> str | None:
        """Why the peer is gone (it closed the connection or exited), or None; never waits
        and reads nothing (a pending message stays for :meth:`recv`)."""
        if self.broken:
            return self.broken
        if b"\n" in self._buf or not self._readable(0):
            return None
        try:
            if not self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                return f"the {self.peer} closed the connection (did it exit?)"
        except BlockingIOError:
            return None
        except OSError as e:
            return f"the connection to the {self.peer} failed: {e}"
        return None

    def _break(self, reason: str) -> NoReturn:
        self.broken = reason
        raise DoorbellError(reason)

    def close(self) -> None:
        self.broken = self.broken or "closed"
        with suppress(OSError):
            self.sock.close()


class DoorbellListener:
    """The trainer's end: accepts one connection per engine worker."""

    def __init__(self, timeout_s: float) -> None:
        self.address = f"vllm_ascend_rl-{secrets.token_hex(8)}"
        self.timeout_s = timeout_s
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind("\0" + self.address)
        self.sock.listen(64)
        self.sock.setblocking(False)

    def accept(self, wait_s: float) -> Doorbell | None:
        ready, _, _ = select.select([self.sock], [], [], wait_s)
        if not ready:
            return None
        conn, _ = self.sock.accept()
        conn.setblocking(True)
        return Doorbell(conn, self.timeout_s, "engine")

    def close(self) -> None:
        self.sock.close()
