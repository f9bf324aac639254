"""``python -m vllm_ascend_rl.doctor`` on this host's real stack, and on broken set-ups it must
catch: each a ``fail`` naming the fix, and a non-zero exit. Run as a user runs it, in a fresh
interpreter (it loads vLLM's general plugins, as a vLLM process does)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.standin_vllm_ascend import real_vllm_ascend_installed

NPU_ONLY = {"vllm-ascend", "torch_npu", "CANN and chips", "ACL back end", "NZ weight format"}
ENV_KEYS = ("RANK_TABLE_FILE", "HCCL_CONNECT_TIMEOUT", "HCCL_EXEC_TIMEOUT")
ENV_KEYS += ("PYTORCH_NPU_ALLOC_CONF",)


def doctor(*args: str, env: dict[str, str] | None = None) -> tuple[int, dict[str, dict]]:
    """Exit code and the checks by name."""
    base = {k: v for k, v in os.environ.items() if k not in ENV_KEYS}
    out = subprocess.run(
        [sys.executable, "-m", "vllm_ascend_rl.doctor", "--json", *args],
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )
    checks = json.loads(out.stdout)
    return out.returncode, {c["name"]: c for c in checks}


def test_the_cpu_stack_passes_and_lists_every_check():
    code, checks = doctor()
    assert code == 0, [c for c in checks.values() if c["status"] == "fail"]
    for name in (
        "python",
        "torch",
        "vllm",
        "device",
        "vllm.general_plugins",
        "vllm.stat_logger_plugins",
        "WeightTransferEngineFactory 'ascend_rl_hccl'",
        "WeightTransferTrainerFactory 'ascend_rl_npu_ipc'",
        "SleepModeBackendFactory 'ascend_rl_camem'",
        "RANK_TABLE_FILE",
        "HCCL_CONNECT_TIMEOUT",
        "HCCL_EXEC_TIMEOUT",
        "PYTORCH_NPU_ALLOC_CONF",
        "VLLM_SERVER_DEV_MODE",
    ):
        assert checks[name]["status"] in ("ok", "warn"), checks[name]
    if not real_vllm_ascend_installed():
        for name in NPU_ONLY:
            assert checks[name]["status"] == "skipped", checks[name]
            assert checks[name]["found"] == "skipped (no NPU)"


BROKEN_ENV = {  # variable: (value, what the fix says)
    "RANK_TABLE_FILE": ("/etc/hccl.json", "unset RANK_TABLE_FILE"),
    "HCCL_EXEC_TIMEOUT": ("1836", "set HCCL_EXEC_TIMEOUT to at most timeout_s (60)"),
    "HCCL_CONNECT_TIMEOUT": ("600", "set HCCL_CONNECT_TIMEOUT to at most timeout_s (60)"),
    "PYTORCH_NPU_ALLOC_CONF": ("expandable_segments:True", "Set expandable_segments:False"),
}


def test_a_broken_environment_fails_naming_each_fix():
    """Four broken settings in one run (a doctor run costs a vLLM import): each fails on
    its own check, naming its fix, and nothing else fails."""
    env = {k: value for k, (value, _) in BROKEN_ENV.items()}
    code, checks = doctor("--timeout-s", "60", env=env)
    assert code == 1
    for name, (_, fix) in BROKEN_ENV.items():
        assert checks[name]["status"] == "fail", checks[name]
        assert fix in checks[name]["fix"], checks[name]
    assert sorted(n for n, c in checks.items() if c["status"] == "fail") == sorted(BROKEN_ENV)


FOREIGN = """
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory


class ForeignEngine:
    pass


def register():
    WeightTransferEngineFactory.register_engine("ascend_rl_hccl", __name__, "ForeignEngine")
"""


def test_a_foreign_engine_under_our_name_fails(tmp_path: Path):
    """A plugin discovered before ours (on PYTHONPATH) takes ``ascend_rl_hccl``: our
    registration logs and skips it, so vLLM would build the foreign engine."""
    (tmp_path / "foreign_plugin.py").write_text(FOREIGN)
    dist = tmp_path / "foreign_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: foreign-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nforeign_plugin = foreign_plugin:register\n"
    )
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    code, checks = doctor(env={"PYTHONPATH": path})
    assert code == 1
    taken = checks["WeightTransferEngineFactory 'ascend_rl_hccl'"]
    assert taken["status"] == "fail"
    assert taken["found"] == "taken by foreign_plugin.ForeignEngine"
    assert "uninstall the plugin that registers 'ascend_rl_hccl'" in taken["fix"]
    assert checks["WeightTransferEngineFactory 'ascend_rl_npu_ipc'"]["status"] == "ok"
