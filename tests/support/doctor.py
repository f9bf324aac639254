"""Run ``python -m vllm_ascend_rl.doctor --json`` as a user runs it, in a fresh interpreter;
or only its ``--engine`` checks, in this process (they are HTTP only; a run costs a vLLM
import)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import asdict

from vllm_ascend_rl.doctor import engines

# Settings a broken set-up test sets; removed from the inherited environment first.
DOCTOR_ENV = ("RANK_TABLE_FILE", "HCCL_CONNECT_TIMEOUT", "HCCL_EXEC_TIMEOUT")
DOCTOR_ENV += ("PYTORCH_NPU_ALLOC_CONF",)


def doctor(
    *args: str, env: dict[str, str] | None = None, cwd: str | None = None
) -> tuple[int, dict[str, dict]]:
    """Exit code and the checks by ``"<area>: <name>"``. It runs in ``cwd`` (default: the
    temporary directory), never in a source tree whose ``*.egg-info`` would come first on
    ``sys.path`` and reorder plugin discovery."""
    base = {k: v for k, v in os.environ.items() if k not in DOCTOR_ENV}
    out = subprocess.run(
        [sys.executable, "-m", "vllm_ascend_rl.doctor", "--json", *args],
        env={**base, **(env or {})},
        cwd=cwd or tempfile.gettempdir(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    return out.returncode, by_name(json.loads(out.stdout))


def engine_checks(*urls: str) -> dict[str, dict]:
    """The doctor's ``--engine`` checks of ``urls``, by ``"<area>: <name>"``."""
    return by_name(asdict(c) for c in engines.checks(list(urls), timeout_s=60))


def by_name(checks: Iterable[dict]) -> dict[str, dict]:
    return {f"{c['area']}: {c['name']}": c for c in checks}
