"""``python -m vllm_ascend_rl.doctor`` on broken set-ups it must catch: each a ``fail`` naming
the fix, and a non-zero exit. Run as a user runs it, in a fresh interpreter (it loads vLLM's
general plugins, as a vLLM process does). On the real CPU stack: tests/e2e/test_doctor.py."""

from __future__ import annotations

import os
from pathlib import Path

from tests.support.doctor import doctor

BROKEN_ENV = {  # variable (its check: "environment: <variable>"): (value, what the fix says)
    "RANK_TABLE_FILE": ("/etc/hccl.json", "unset RANK_TABLE_FILE"),
    "HCCL_EXEC_TIMEOUT": ("1836", "set HCCL_EXEC_TIMEOUT to at most timeout_s (60)"),
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
