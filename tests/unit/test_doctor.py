"""``python -m vllm_ascend_rl.doctor`` on broken set-ups it must catch: each a ``fail`` naming
the fix, and a non-zero exit. Run as a user runs it, in a fresh interpreter (it loads vLLM's
general plugins, as a vLLM process does). On the real CPU stack: tests/e2e/test_doctor.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.doctor import by_name, doctor
from vllm_ascend_rl.doctor import local

BROKEN_ENV = {  # variable (its check: "environment: <variable>"): (value, what the fix says)
    "RANK_TABLE_FILE": ("/etc/hccl.json", "unset RANK_TABLE_FILE"),
    "HCCL_EXEC_TIMEOUT": ("ten", "set HCCL_EXEC_TIMEOUT to a whole number of seconds"),
    "HCCL_CONNECT_TIMEOUT": ("600", "set HCCL_CONNECT_TIMEOUT to at most timeout_s (60)"),
    "PYTORCH_NPU_ALLOC_CONF": ("expandable_segments:True", "Set expandable_segments:False"),
}


TAKEN = "registration: WeightTransferEngineFactory 'ascend_rl_hccl'"

FOREIGN = """
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory


class ForeignEngine:
    pass


def register():
    WeightTransferEngineFactory.register_engine("ascend_rl_hccl", __name__, "ForeignEngine")
"""


def test_a_broken_set_up_fails_naming_each_fix(tmp_path: Path):
    """One run (a doctor run costs a vLLM import) with four broken settings and a plugin
    discovered before ours (on PYTHONPATH) that takes ``ascend_rl_hccl``: our registration
    logs and skips the name, so vLLM would build the foreign engine. Each fails on its own
    check, naming its fix, and nothing else fails."""
    (tmp_path / "foreign_plugin.py").write_text(FOREIGN)
    dist = tmp_path / "foreign_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: foreign-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nforeign_plugin = foreign_plugin:register\n"
    )
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    env = {"PYTHONPATH": path, **{k: value for k, (value, _) in BROKEN_ENV.items()}}
    code, checks = doctor("--timeout-s", "60", env=env, cwd=str(tmp_path))
    assert code == 1
    for name, (_, fix) in BROKEN_ENV.items():
        check = checks[f"environment: {name}"]
        assert check["status"] == "fail", check
        assert fix in check["fix"], check
    taken = checks[TAKEN]
    assert taken["status"] == "fail"
    assert taken["found"] == "taken by foreign_plugin.ForeignEngine"
    assert "uninstall the plugin that registers 'ascend_rl_hccl'" in taken["fix"]
    assert checks["registration: WeightTransferEngineFactory 'ascend_rl_npu_ipc'"]["status"] == "ok"
    failed = sorted(n for n, c in checks.items() if c["status"] == "fail")
    assert failed == sorted([TAKEN, *(f"environment: {name}" for name in BROKEN_ENV)])


# (frontend PYTORCH_NPU_ALLOC_CONF, --additional-config) -> what vllm-ascend@182b75e's frontend
# hands the engine core (platform.py:374, 395, 1208-1244), and the doctor's verdict on NPU.
ROUTES = [
    ("expandable_segments:False", {"weight_nz_mode": 0}, "expandable_segments:False", "ok"),
    (
        "expandable_segments:False",
        {"rl_config": {"enabled": True}},
        ",expandable_segments:True",
        "warn",
    ),
    (None, {"rl_config": {"enabled": True}}, "expandable_segments:True", "warn"),
    (None, {"weight_nz_mode": 0}, "expandable_segments:True", "fail"),
    ("page_size:1g", {"weight_nz_mode": 0}, "page_size:1g,expandable_segments:True", "fail"),
    (
        "expandable_segments:True",
        {"rl_config": {"enabled": True}},
        ",expandable_segments:True",
        "fail",
    ),
]


@pytest.mark.parametrize("frontend, additional_config, engine_core, status", ROUTES)
def test_the_allocator_check_judges_what_the_engine_core_gets(
    monkeypatch, frontend, additional_config, engine_core, status
):
    """The engine core's ``PYTORCH_NPU_ALLOC_CONF`` is what vllm-ascend's frontend hands it;
    only ``expandable_segments:False`` with ``weight_nz_mode: 0`` leaves it untouched. With
    ``rl_config`` the worker strips the appended ``True`` late (worker.py:129): a warning."""
    assert local.engine_core_alloc_conf(frontend, additional_config) == engine_core
    if frontend is None:
        monkeypatch.delenv("PYTORCH_NPU_ALLOC_CONF", raising=False)
    else:
        monkeypatch.setenv("PYTORCH_NPU_ALLOC_CONF", frontend)
    checks = by_name(vars(c) for c in local.environment(True, 60, additional_config))
    check = checks["environment: PYTORCH_NPU_ALLOC_CONF"]
    assert check["status"] == status, check
    assert repr(engine_core) in check["found"]
    if status != "ok":
        assert (
            """expandable_segments:False and --additional-config '{"weight_nz_mode": 0}'"""
            in (check["fix"])
        )
    nz = checks["environment: NZ weight format"]
    assert nz["status"] == "ok", nz  # both routes turn NZ off


@pytest.mark.parametrize(
    "value, status",
    [(None, "ok"), ("600", "ok"), ("1836", "ok"), ("0", "ok"), ("ten", "fail"), ("inf", "fail")],
)
def test_hccl_exec_timeout_is_vllm_ascends_own_groups_business(monkeypatch, value, status):
    """Our group sets its own exec timeout; the variable serves vllm-ascend's own groups (its
    tutorials set 200-600 s), whatever timeout_s is."""
    if value is None:
        monkeypatch.delenv("HCCL_EXEC_TIMEOUT", raising=False)
    else:
        monkeypatch.setenv("HCCL_EXEC_TIMEOUT", value)
    checks = by_name(vars(c) for c in local.environment(False, 60))
    assert checks["environment: HCCL_EXEC_TIMEOUT"]["status"] == status


@pytest.mark.parametrize(
    "cann, status",
    [("9.1.0", "ok"), ("9.2.RC1", "ok"), ("8.3.RC1.alpha002", "warn"), ("", "warn")],
)
def test_any_cann_version_string_gets_a_verdict(monkeypatch, cann, status):
    """CANN versions are not PEP 440 (``8.3.RC1.alpha002``): never a traceback."""
    from vllm_ascend_rl.device import npu

    monkeypatch.setattr(npu, "chips_and_cann", lambda: (2, cann))  # no NPU here: its answer
    check = local._cann_and_chips()
    assert check.status == status, check


def test_a_server_reporting_another_weight_transfer_backend_fails_with_the_flag_to_use():
    from vllm_ascend_rl.doctor.engines import configuration

    config = {"weight_transfer_config": {"backend": "nccl"}, "scheduler_config": {}}
    transfer, scheduler = configuration("engine x", config)
    assert (transfer.status, transfer.found) == ("fail", "backend 'nccl', not the plugin's")
    assert """--weight-transfer-config '{"backend": "ascend_rl_hccl"}'""" in transfer.fix
    assert scheduler.status == "fail" and "--scheduler-cls vllm_ascend_rl" in scheduler.fix
