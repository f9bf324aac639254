"""The NPU-IPC transport's CPU back end (POSIX shared memory) and its doorbell."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
import time

import pytest
import torch

from vllm_ascend_rl.device import IpcHandleError, get_device
from vllm_ascend_rl.weight_transfer.doorbell import (
    Abort,
    Done,
    Doorbell,
    DoorbellError,
    DoorbellListener,
    Filled,
    Hello,
    Ready,
    Welcome,
)
from vllm_ascend_rl.weight_transfer.wire import Verdict

CPU = get_device("cpu")


def shm_path(handle: dict) -> str:
    return "/dev/shm/" + handle["name"]


def test_segments_are_private_randomly_named_and_shared():
    a, b = CPU.create_ipc_buffer(4096), CPU.create_ipc_buffer(4096)
    try:
        assert stat.S_IMODE(os.stat(shm_path(a.handle)).st_mode) == 0o600
        a.tensor[:] = torch.arange(4096) % 251
        mapped = CPU.open_ipc_buffer(a.handle)
        assert torch.equal(mapped.tensor, a.tensor)
        mapped.tensor[0] = 99  # the same memory, not a copy
        assert a.tensor[0] == 99
        mapped.close()
    finally:
        a.close()
        assert os.path.exists(shm_path(b.handle))  # b's block still holds the segment
        b.close()
    assert not os.path.exists(shm_path(a.handle))


@pytest.mark.parametrize(
    "slot, per_segment",
    [(128 << 10, 15), (1 << 20, 19), (8 << 20, 2), (12 << 20, 1)],
    ids=["128KiB", "1MiB", "8MiB", "12MiB"],
)
def test_ring_slots_share_segments_as_the_caching_allocator_serves_them(slot, per_segment):
    """[N2] Small slots (with a 32-byte pad) come from one 2 MiB segment, larger ones up to
    10 MiB from one 20 MiB segment (torch_npu's get_allocation_size), so their handles name
    the same segment with
    different offsets. An importer that caches mappings by handle id, as the NPU-IPC engine
    does, must still see every slot's own bytes: the id carries the offset."""
    ring = [CPU.create_ipc_buffer(slot) for _ in range(4)]
    try:
        names = [b.handle["name"] for b in ring]
        assert len(set(names)) == -(-4 // per_segment)
        assert len({(b.handle["name"], b.handle["offset"]) for b in ring}) == 4
        for i, buf in enumerate(ring):
            buf.tensor.fill_(i + 1)
        mapped: dict[str, object] = {}
        for buf in ring:
            if buf.handle["id"] not in mapped:
                mapped[buf.handle["id"]] = CPU.open_ipc_buffer(buf.handle)
        for i, buf in enumerate(ring):
            seen = mapped[buf.handle["id"]].tensor
            assert seen.numel() == slot and bool((seen == i + 1).all()), f"slot {i}"
        for m in mapped.values():
            m.close()
    finally:
        for buf in ring:
            buf.close()
    assert not any(os.path.exists("/dev/shm/" + n) for n in names)


def test_an_unlinked_segment_is_not_carved_from_again():
    """After the trainer unlinks its ring (every engine mapped it), a new buffer must come
    from a segment an importer can still open."""
    first = CPU.create_ipc_buffer(4096)
    first.unlink()
    second = CPU.create_ipc_buffer(4096)
    try:
        assert second.handle["name"] != first.handle["name"]
        CPU.open_ipc_buffer(second.handle).close()
    finally:
        first.close()
        second.close()


def test_unlink_keeps_existing_mappings_but_refuses_new_ones():
    buf = CPU.create_ipc_buffer(1024)
    mapped = CPU.open_ipc_buffer(buf.handle)
    buf.unlink()
    assert not os.path.exists(shm_path(buf.handle))
    buf.tensor[5] = 42
    assert mapped.tensor[5] == 42
    with pytest.raises(IpcHandleError, match="does not exist"):
        CPU.open_ipc_buffer(buf.handle)
    mapped.close()
    buf.close()


def test_segments_of_a_crashed_trainer_are_removed():
    code = (
        "import os\nfrom vllm_ascend_rl.device import get_device\n"
        "b = get_device('cpu').create_ipc_buffer(1 << 20)\n"
        "print(b.handle['name'], flush=True)\nos._exit(3)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    name = out.stdout.strip().splitlines()[-1]
    deadline = time.monotonic() + 30
    while os.path.exists("/dev/shm/" + name):  # Python's resource tracker cleans up
        assert time.monotonic() < deadline, f"{name} leaked after the trainer crashed"
        time.sleep(0.2)


def test_an_importer_exiting_does_not_unlink_the_trainers_segment():
    buf = CPU.create_ipc_buffer(1024)
    try:
        code = (
            "import json, sys\nfrom vllm_ascend_rl.device import get_device\n"
            "m = get_device('cpu').open_ipc_buffer(json.loads(sys.argv[1]))\n"
            "print(int(m.tensor[0]))\n"
        )
        import json

        buf.tensor[0] = 17
        out = subprocess.run(
            [sys.executable, "-c", code, json.dumps(buf.handle)],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        assert out.stdout.strip() == "17"
        time.sleep(1)
        assert os.path.exists(shm_path(buf.handle))
    finally:
        buf.close()


def test_size_and_location_are_checked():
    buf = CPU.create_ipc_buffer(1024)
    try:
        with pytest.raises(IpcHandleError, match=r"holds .* bytes, handle says"):
            CPU.open_ipc_buffer({**buf.handle, "nbytes": 1 << 30})
        with pytest.raises(IpcHandleError, match="malformed shared-memory handle: offset"):
            CPU.open_ipc_buffer({**buf.handle, "offset": -1})
        far = {**buf.handle, "location": {**buf.handle["location"], "host": "b", "chip": "3"}}
        with pytest.raises(IpcHandleError, match="trainer on chip 3 of host b, engine on chip"):
            CPU.open_ipc_buffer(far)
    finally:
        buf.close()


def doorbell_pair(timeout_s: float) -> tuple[DoorbellListener, Doorbell, Doorbell]:
    """A listener, and the trainer's and an engine worker's ends of one connection to it."""
    listener = DoorbellListener(timeout_s=timeout_s)
    engine_side: list[Doorbell] = []
    t = threading.Thread(
        target=lambda: engine_side.append(Doorbell.connect(listener.address, timeout_s))
    )
    t.start()
    trainer_side = None
    while trainer_side is None:
        trainer_side = listener.accept(0.1)
    t.join()
    return listener, trainer_side, engine_side[0]


def test_a_worker_hello_from_another_chip_is_refused_naming_both():
    from vllm_ascend_rl.weight_transfer.npu_ipc import AscendRLNPUIPCWeightTransferInitInfo
    from vllm_ascend_rl.weight_transfer.npu_ipc_trainer import welcome
    from vllm_ascend_rl.weight_transfer.wire import wire_signature

    listener, trainer_side, engine = doorbell_pair(5.0)
    try:
        info = AscendRLNPUIPCWeightTransferInitInfo(doorbells={"cpu0": listener.address})
        here, wire = CPU.location(), wire_signature(info, None)
        assert not welcome(
            trainer_side, Hello(worker=1, wire=wire, location=here, step_hold=2), wire + 1, here
        )
        error = engine.expect(Welcome, None, "hello answer").reason
        assert error is not None and "disagree on protocol or wire parameters" in error, error
        elsewhere = {**here, "chip": "cpu5"}
        assert not welcome(
            trainer_side, Hello(worker=1, wire=wire, location=elsewhere, step_hold=2), wire, here
        )
        error = engine.expect(Welcome, None, "hello answer").reason
        assert error is not None and error.startswith(
            f"engine worker 1: trainer and engine are not on the same chip: "
            f"trainer on chip {here['chip']} of host {here['host']}, "
            f"engine on chip cpu5 of host {here['host']}"
        ), error
        assert welcome(
            trainer_side, Hello(worker=1, wire=wire, location=here, step_hold=2), wire, here
        )
        assert engine.recv("hello answer") == Welcome(reason=None)
    finally:
        for d in (trainer_side, engine, listener):
            d.close()


def test_doorbell_round_trip_eof_and_timeout():
    listener, trainer_side, engine = doorbell_pair(1.0)
    trainer_side.send(Filled(id=3))
    assert engine.expect(Filled, 3, "test") == Filled(id=3)
    t0 = time.monotonic()
    with pytest.raises(DoorbellError, match="no message from the trainer within timeout_s=1s"):
        engine.recv("silence")
    assert 0.9 < time.monotonic() - t0 < 5
    trainer_side.close()
    engine2_side = Doorbell(engine.sock, 1.0, "trainer")  # same socket, fresh state
    with pytest.raises(DoorbellError, match="closed the connection"):
        engine2_side.recv("eof")
    listener.close()
    with pytest.raises(DoorbellError, match="cannot reach"):
        Doorbell.connect(listener.address, 1.0)


def test_a_refusal_that_lands_while_the_poll_fails_wins_over_the_failure():
    """A worker sends its refusal, then its update call fails. If both happen between the
    trainer's look at the socket and its poll, the refusal is still what the trainer reads
    (the connection stays usable); a poll failure with nothing arrived is raised."""
    listener, trainer_side, engine_side = doorbell_pair(5.0)
    try:

        def refused_then_failed() -> None:
            engine_side.send(Ready(id=1, verdict=Verdict.REFUSED, reason="refused"))
            time.sleep(0.1)  # the refusal is in the trainer's socket
            raise RuntimeError("update_weights failed")

        msg = trainer_side.expect(Ready, 1, "handshake", refused_then_failed)
        assert msg == Ready(id=1, verdict=Verdict.REFUSED, reason="refused")
        assert not trainer_side.broken

        def failed() -> None:
            raise RuntimeError("update_weights failed")

        with pytest.raises(RuntimeError, match="update_weights failed"):
            trainer_side.expect(Ready, 2, "handshake", failed)
    finally:
        trainer_side.close()
        engine_side.close()
        listener.close()


@pytest.mark.parametrize(
    "line, problem",
    [
        (b"not json", "Invalid JSON"),
        (b'{"kind": "ready", "id": 1, "verdict": 2}', "ready.verdict: Input should be 0 or 1"),
        (b'{"kind": "done", "id": "1"}', "done.id: Input should be a valid integer"),
        (b'{"kind": "done", "id": 1, "error": "x"}', "done.error: Extra inputs are not permitted"),
        (b'{"kind": "hi"}', "does not match any of the expected tags: 'hello', 'welcome'"),
    ],
)
def test_a_malformed_message_breaks_the_doorbell_saying_what_came(line, problem):
    listener, trainer_side, engine_side = doorbell_pair(5.0)
    try:
        engine_side.sock.sendall(line + b"\n")
        with pytest.raises(DoorbellError, match="malformed message from the engine") as e:
            trainer_side.recv("update handshake")
        assert str(e.value).startswith("update handshake: ") and problem in str(e.value)
        assert repr(line) in str(e.value) and trainer_side.broken == str(e.value)
    finally:
        for d in (trainer_side, engine_side, listener):
            d.close()


def test_an_unexpected_id_or_an_abort_breaks_the_doorbell():
    listener, trainer_side, engine_side = doorbell_pair(5.0)
    try:
        engine_side.send(Done(id=2))
        with pytest.raises(
            DoorbellError, match=r"ack: expected Done\(id=3\) from the engine, got Done\("
        ):
            trainer_side.expect(Done, 3, "ack")
        trainer_side.send(Abort(reason="the trainer gave up"))
        with pytest.raises(DoorbellError, match="wait: the trainer aborted: the trainer gave up"):
            engine_side.expect(Filled, 0, "wait")
        assert engine_side.broken
    finally:
        for d in (trainer_side, engine_side, listener):
            d.close()


@pytest.mark.parametrize("nbytes", [1000, (8 << 20) + 13, (40 << 20) + 7])
def test_cpu_staging_copy_is_exact_on_every_path(nbytes):
    """Small copies take numpy's memcpy, large ones the multi-threaded one (uneven slices)."""
    device = get_device("cpu")
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.zeros(nbytes + 64, dtype=torch.uint8)
    device.copy_bytes(dst[32 : 32 + nbytes], src)
    assert torch.equal(dst[32 : 32 + nbytes], src)
    assert not dst[:32].any() and not dst[32 + nbytes :].any()  # nothing written outside


def test_host_copy_refuses_overlap_and_size_mismatch():
    from npu_standin.native import host_copy

    buf = torch.zeros(16 << 20, dtype=torch.uint8)
    with pytest.raises(ValueError, match="overlap"):
        host_copy(buf.data_ptr() + 1, buf.data_ptr(), 8 << 20, 2)
    with pytest.raises(ValueError, match="null"):
        host_copy(0, buf.data_ptr(), 8, 2)
    with pytest.raises(ValueError, match="non-negative"):  # ctypes would wrap it
        host_copy(-1, buf.data_ptr(), 8, 2)
    with pytest.raises(ValueError, match="bytes into"):
        get_device("cpu").copy_bytes(buf[: 9 << 20], buf[10 << 20 :])
