"""Every torch_npu API the plugin uses, checked against every build a supported stack pins
(``vllm_ascend_rl.stacks``), read from its wheel without importing it
(tests/support/torch_npu_wheel.py), and against the newest build on the index, which reports
what would break instead of failing. The list of uses is derived from our
sources (tests/support/torch_npu_uses.py), so a new call is checked the day it is written;
Python APIs are checked by their signatures in the wheel's sources, the extension's by the
names it binds. What cannot be checked from the wheel is named. Tensor methods torch generates
for the device (``Tensor.npu``) and torch's own members are not torch_npu's and not listed."""

from __future__ import annotations

import ast
import functools
import math

import pytest

from tests.support.torch_npu_uses import NOT_IN_WHEEL, PATCHED, check, uses
from tests.support.torch_npu_wheel import NEWEST, PINNED, ROOT, Build, wheel
from vllm_ascend_rl.device import base, npu
from vllm_ascend_rl.device.group import hccl_config

SOURCES = ("vllm_ascend_rl", "examples", "tests/npu")
HARDWARE_MODULE = "vllm_ascend_rl/device/npu.py"  # the only product module that may use torch_npu


@pytest.fixture(scope="module", params=PINNED)
def build(request) -> Build:
    return Build(wheel(request.param))


@functools.cache
def our_uses() -> tuple:
    """Every torch_npu use in our sources, read once for all the builds checked."""
    return tuple(
        use
        for top in SOURCES
        for path in sorted((ROOT / top).rglob("*.py"))
        for use in uses(path.read_text(), path.relative_to(ROOT).as_posix())
    )


def missing_in(build: Build) -> tuple[list, list[str], list[str]]:
    """Our uses checked, what ``build`` lacks of them, and what no wheel can show."""
    found = our_uses()
    unchecked = sorted({u.name for u in found if u.name.split(".")[0] in NOT_IN_WHEEL})
    checked = [u for u in found if u.name.split(".")[0] not in NOT_IN_WHEEL]
    missing = [f"{u.where}: {problem}" for u in checked if (problem := check(build, u))]
    return checked, missing, unchecked


def test_every_torch_npu_api_the_plugin_uses_is_in_each_pinned_build(build, report):
    found = our_uses()
    checked, missing, unchecked = missing_in(build)
    assert not missing, "\n".join(missing)
    report(
        f"checked {len(checked)} uses of {len({u.name for u in checked})} torch_npu APIs "
        f"against torch-npu {build.version}; not checkable from the wheel: "
        + ", ".join(f"{n} ({NOT_IN_WHEEL[n.split('.')[0]]})" for n in unchecked)
    )
    assert unchecked == ["acl.rt.memcpy"]  # a new one must be named here, with its reason
    product = {u.where.split(":")[0] for u in found if u.where.startswith("vllm_ascend_rl/")}
    assert product == {HARDWARE_MODULE}, "torch_npu is called outside device/npu.py"


def test_the_newest_torch_npu_on_the_index_is_probed(report):
    """A forward probe: what the next torch_npu lacks is reported, not failed."""
    checked, missing, _ = missing_in(Build(wheel(NEWEST)))
    report(
        f"forward probe, torch-npu {NEWEST}: {len(checked)} uses checked, "
        + (f"{len(missing)} missing: " + "; ".join(missing) if missing else "none missing")
    )


@pytest.mark.parametrize(
    "written, misspelled, named",
    [
        ("memory_snapshot()", "memory_snapshots()", "memory_snapshots"),  # an API it lacks
        ("device=allocator", "device_index=allocator", "device_index"),  # a keyword
        ("set_watchdog_status(", "set_watchdog_statuz(", "set_watchdog_statuz"),  # a method
        ("options.group_id =", "options.groupid =", "groupid"),  # a field of its options
        ('segment["segment_pool_id"]', 'segment["segment_pool"]', "segment_pool"),  # a key
    ],
)
def test_a_misspelled_call_fails_the_check(build, written, misspelled, named):
    source = (ROOT / HARDWARE_MODULE).read_text()
    assert written in source
    broken = [check(build, u) for u in uses(source.replace(written, misspelled), "npu.py")]
    assert any(p and named in p for p in broken), broken


def test_torch_reduce_tensor_is_the_one_torch_npu_installs(build):
    """``reduce_tensor`` is torch's name; torch_npu replaces it at import with its own."""
    ((name, target),) = PATCHED.items()
    assignment = f"{name} = {target.rpartition('.')[2]}"
    assert assignment in build.sources["torch_npu/multiprocessing/reductions.py"]


def rebuild_parameters(build: Build) -> list[str]:
    path, node, rest = build.resolve("torch_npu.multiprocessing.reductions.rebuild_npu_tensor")
    assert not rest and isinstance(node, ast.FunctionDef), path
    return [a.arg for a in node.args.args]


def test_npu_ipc_handles_carry_the_fields_rebuild_npu_tensor_takes(build):
    """Our names of the IPC rebuild arguments are the build's, in its order (N2: the storage
    handle and the storage offset, not the tensor offset, name a buffer)."""
    assert list(npu.REBUILD_ARGS) == rebuild_parameters(build)


def test_a_buffer_is_named_by_its_segment_and_its_offset_in_it(build):
    """The id code (N2) on rebuild arguments laid out as the build lays them out, each field a
    distinct value: two buffers of one segment differ by their storage offset alone."""
    names = rebuild_parameters(build)
    location = {"host": "h", "boot_id": "b", "chip": "0"}

    def exported(storage_offset: int):
        values = {n: f"<{n}>" for n in names}
        values |= {"storage_handle": b"segment-7", "storage_offset_bytes": storage_offset}
        values |= {"tensor_offset": 0, "storage_size_bytes": 4 << 20, "ref_counter_offset": 3}
        values |= {"ref_counter_handle": b"ref", "event_handle": None, "requires_grad": False}
        values |= {"event_sync_required": False}
        return npu.ipc_handle(tuple(values[n] for n in names), 1 << 20, location)

    first, second = exported(0), exported(1 << 20)
    assert first["id"] == base.ipc_buffer_id(b"segment-7", 0)
    assert second["id"] == base.ipc_buffer_id(b"segment-7", 1 << 20) != first["id"]
    rebuilt = dict(zip(names, npu.rebuild_args(second, device_index=3), strict=True))
    assert rebuilt["storage_handle"] == b"segment-7"
    assert rebuilt["storage_offset_bytes"] == 1 << 20
    assert rebuilt["storage_device"] == 3 and rebuilt["tensor_size"] == (1 << 20,)
    assert rebuilt["ref_counter_handle"] == b"ref" and rebuilt["ref_counter_offset"] == 3


def test_the_weight_group_bounds_a_collective_hung_on_a_dead_peer(build):
    """The exec timeout (N3): HCCL holds a collective on a dead peer, and every device-wide
    wait behind it, for ``hccl_exec_timeout`` seconds (an int32, ProcessGroupHCCL.cpp:
    3998-4013), else HCCL_EXEC_TIMEOUT's 1836 s; the group sets it to ``timeout_s`` rounded
    up, and the buffer as vllm-ascend sizes its groups'."""
    config = hccl_config(timeout_s=7.2, group_id="tcp://127.0.0.1:29500/vllm_ascend_rl_weights/")
    assert config["hccl_exec_timeout"] == math.ceil(7.2)
    assert isinstance(config["hccl_exec_timeout"], int) and 0 < config["hccl_exec_timeout"] < 2**31
    assert config["hccl_buffer_size"] == 200
    assert config["group_name"] == "tcp_127_0_0_1_29500_vllm_ascend_rl_weights"
    assert all(build.binds(key) for key in config)
