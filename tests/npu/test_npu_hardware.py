"""The NPU-facing calls on real hardware: HCCL group, NPU IPC handles, ACL virtual memory.

Written for the first Ascend host (``make test-npu``); skipped everywhere else, and never run
by us (no NPU was available). Each test exercises one seam of ``device/npu.py`` or
``csrc/vmm_acl.cpp`` that CPU CI can only stand in for; see docs/ascend-conformance.md.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.ascend, pytest.mark.npu_only, pytest.mark.timeout(600)]

MiB = 1 << 20

# The HCCL test's rank processes. A collective left on the HCCL stream (the orphaned broadcast)
# holds every device-wide synchronize, the one torch_npu runs at interpreter exit included,
# until its exec timeout: the communicator's own (about TIMEOUT_S, set by device/npu.py), else
# HCCL_EXEC_TIMEOUT, 1836 s by default. So the ranks bound it to EXEC_TIMEOUT_S as well: 68 s
# is valid on every Atlas product (A2/A3 take any whole second; older ones round down to a
# multiple of 68). HCCL_CONNECT_TIMEOUT bounds setting up the links; 120 s is its minimum.
TIMEOUT_S = 20  # the channel's timeout_s
EXEC_TIMEOUT_S = 68
CONNECT_TIMEOUT_S = 120
HCCL_ENV = {
    "HCCL_EXEC_TIMEOUT": str(EXEC_TIMEOUT_S),
    "HCCL_CONNECT_TIMEOUT": str(CONNECT_TIMEOUT_S),
}
STARTUP_S = 120  # importing torch_npu and vllm_ascend_rl, opening the device
# A rank lives through start-up, the links (HCCL adds 20 s to the connect timeout), our
# timeout on the orphan and, at exit, the device sync waiting out the exec timeout.
RANK_LIFETIME_S = STARTUP_S + CONNECT_TIMEOUT_S + 20 + TIMEOUT_S + EXEC_TIMEOUT_S + 60


def _run(code: str, env: dict[str, str], *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env={**os.environ, "VLLM_ASCEND_RL_DEVICE": "npu", **env},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _chip(i: int) -> dict[str, str]:
    from tests.support.profile import current_profile

    return current_profile().chips_env([i])


HCCL_RANK = """
    import sys, time, torch, torch_npu
    from vllm_ascend_rl.device import current_device
    from vllm_ascend_rl.weight_transfer.channel import BroadcastChannel, ChannelError
    from vllm_ascend_rl.weight_transfer.wire import Verdict
    port, rank = int(sys.argv[1]), int(sys.argv[2])
    torch.npu.set_device(0)
    dev = current_device()
    ch = BroadcastChannel.open(dev, "127.0.0.1", port, rank, 2, int(sys.argv[3]))
    assert ch.agree(Verdict.GO, 7, "probe") == (Verdict.GO, True)
    want = torch.arange(1 << 20, dtype=torch.int64).to(torch.uint8)
    t = (want if rank == 0 else torch.zeros_like(want)).to(dev.torch_device())
    ch.wait(ch.broadcast(t), "payload")
    assert torch.equal(t.cpu(), want), "broadcast differs"
    if rank == 1:
        print("rank 1 leaves", flush=True)
        sys.exit(0)  # never joins the next collective
    t0 = time.monotonic()
    try:
        ch.wait(ch.broadcast(t), "orphan")
        raise SystemExit("the orphaned broadcast completed")
    except ChannelError as e:
        waited = time.monotonic() - t0
    t1 = time.monotonic()
    ch.close()  # must abort the communicator, not wait on the hung stream
    print("ok", round(waited, 1), round(time.monotonic() - t1, 1), flush=True)
    # Exit: torch_npu synchronizes the device, which waits out the orphan's exec timeout.
"""


@pytest.mark.timeout(RANK_LIFETIME_S + 60)
def test_hccl_group_broadcasts_and_survives_a_vanished_peer():
    """[A1, A7, N4] The group forms over HCCL; a peer that leaves gives our error within
    timeout_s, the close does not hang, and the process is not taken down: it goes on to
    report, then exits once the device has dropped the orphaned broadcast."""
    from tests.support import free_port

    port = str(free_port())
    ranks = [
        _run(HCCL_RANK, {**_chip(r), **HCCL_ENV}, port, str(r), str(TIMEOUT_S)) for r in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=RANK_LIFETIME_S) for p in ranks]
    finally:
        for p in ranks:
            p.kill()
            p.wait()
    leaver, survivor = ranks[1], ranks[0]
    assert leaver.returncode == 0 and "rank 1 leaves" in outs[1][0], outs[1][1][-3000:]
    # The survivor's exit status is the runtime's account of the orphan it waited out at
    # exit, not ours; what it reported before is.
    lines = outs[0][0].split("\n")
    report = next((line.split() for line in lines if line.startswith("ok ")), None)
    assert report is not None, (
        f"rank 0 exited with {survivor.returncode} without reporting:\n{outs[0][1][-3000:]}"
    )
    waited, closed = float(report[1]), float(report[2])
    assert waited < TIMEOUT_S + 10 and closed < 10, outs[0][0]


IPC_EXPORTER = """
    import json, sys, torch, torch_npu
    from vllm_ascend_rl.device import current_device
    torch.npu.set_device(0)
    buf = current_device().create_ipc_buffer(8 << 20)
    buf.tensor.copy_(torch.arange(8 << 20, dtype=torch.int64).to(torch.uint8).npu())
    torch.npu.synchronize()
    print(json.dumps(buf.handle), flush=True)
    sys.stdin.readline()  # keep the buffer alive until the importer is done
"""

IPC_IMPORTER = """
    import json, sys, torch, torch_npu
    from vllm_ascend_rl.device import current_device
    torch.npu.set_device(0)
    dev, handle = current_device(), json.loads(sys.argv[1])
    want = torch.arange(8 << 20, dtype=torch.int64).to(torch.uint8)
    for _ in range(2):  # the second open hits torch_npu's handle cache (A9)
        mapped = dev.open_ipc_buffer(handle)
        assert torch.equal(mapped.tensor.cpu(), want)
    mapped.close()
    print("ok", flush=True)
"""


def test_ipc_handles_round_trip_between_processes_on_one_chip():
    """[A9, A11] Export as JSON, import in another process on the same chip, twice."""
    exporter = _run(IPC_EXPORTER, _chip(0))
    handle = exporter.stdout.readline().strip()
    importer = _run(IPC_IMPORTER, _chip(0), handle)
    out, err = importer.communicate(timeout=300)
    exporter.kill()
    exporter.communicate()
    assert importer.returncode == 0 and out.strip() == "ok", err[-3000:]


def test_acl_virtual_memory_sleeps_wakes_and_zeroes():
    """[A3, A6, A10, S1] Pool allocations through torch_npu's pluggable allocator; contents
    survive level 1, a discarded tag wakes as zeros, addresses never move."""
    import torch

    from vllm_ascend_rl import vmm
    from vllm_ascend_rl.sleep.allocator import CaMemAllocator

    assert "acl" in vmm.backends(), "the extension was built without CANN"
    torch.npu.set_device(0)
    # The process's one allocator: the pool's C callbacks report to it (N5).
    alloc = CaMemAllocator.get_instance("acl", device=0)
    assert not alloc.maps_zeroed
    with alloc.use_memory_pool("weights"):
        w = torch.full((4 * MiB,), 7, dtype=torch.uint8, device="npu:0")
    with alloc.use_memory_pool("kv_cache"):
        kv = torch.full((4 * MiB,), 9, dtype=torch.uint8, device="npu:0")
    ptrs = (w.data_ptr(), kv.data_ptr())
    assert all(a.size % (2 * MiB) == 0 for a in alloc.allocations.values())  # granularity
    alloc.sleep(offload_tags=("weights",))
    assert alloc.get_current_usage() == 0
    alloc.wake_up()
    assert (w.data_ptr(), kv.data_ptr()) == ptrs
    assert int(w.min()) == 7 == int(w.max()), "weights not restored"
    assert int(kv.abs().max()) == 0, "discarded tag did not wake zeroed"


def test_pool_trims_segments_freed_during_loading():
    """[S6, N5] Memory freed inside a pool is given back when the block ends; the pool's
    callbacks report to the process's one allocator, which the previous test used too."""
    import torch

    from vllm_ascend_rl.sleep.allocator import CaMemAllocator

    torch.npu.set_device(0)
    alloc = CaMemAllocator.get_instance("acl", device=0)
    before = alloc.get_current_usage()
    with alloc.use_memory_pool("weights"):
        kept = torch.empty(8 * MiB, dtype=torch.uint8, device="npu:0")
        scratch = torch.empty(64 * MiB, dtype=torch.uint8, device="npu:0")
        del scratch
    held = alloc.get_current_usage() - before
    assert 8 * MiB <= held < 64 * MiB, held
    del kept


def test_nz_format_is_reported_before_the_first_sync():
    """[A2] With vllm-ascend's defaults, the engine says what to change at start-up."""
    pytest.importorskip("vllm_ascend")
    from vllm_ascend_rl.device.npu import nz_format_refusal, nz_weight_mode

    os.environ.pop("VLLM_ASCEND_ENABLE_NZ", None)
    mode = nz_weight_mode()
    assert (nz_format_refusal() is None) == (mode == 0)
