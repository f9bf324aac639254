"""Kill an engine while a trainer is in the middle of syncing it."""

from __future__ import annotations

import threading
import time

from tests.support import VLLMServer
from tests.support.trainer import TrainerError, TrainerProcess

STALL_S = 3  # the trainer stalls this long after a few tensors; the kill lands inside


def kill_mid_sync(
    trainer: TrainerProcess, engine: VLLMServer, timeout_s: float, url: str | None = None
) -> tuple[str, float]:
    """SIGKILL ``engine``'s engine core and workers while ``trainer`` stalls mid-transfer to
    it; the trainer's error message and the seconds from the kill to the failure. Fails the
    test if the send did not fail or hung."""
    engine.pids()  # alive and known before the kill
    engine.wait_for_chip_sharers()  # not while the kill lands: the send would outlast its stall
    failure: list[BaseException] = []

    def send() -> None:
        try:
            trainer.send(url=url, stall_after_tensors=8, stall_s=STALL_S)
        except BaseException as e:
            failure.append(e)

    sender = threading.Thread(target=send)
    sender.start()
    time.sleep(STALL_S / 2)  # inside the stall: a few buckets have landed
    engine.kill_engine()
    killed = time.monotonic()
    sender.join(timeout_s + 60)
    elapsed = time.monotonic() - killed
    assert not sender.is_alive(), "send_weights hung after the engine died"
    assert failure and isinstance(failure[0], TrainerError), failure
    message = str(failure[0])
    assert elapsed < STALL_S + timeout_s + 10, f"failed {elapsed:.0f}s after the kill: {message}"
    assert engine.url in message, message
    trainer.request("ping")  # the trainer process itself is fine
    return message, elapsed
