"""``.github/workflows/ascend.yml`` on CPU: what needs no NPU runs here, so the workflow cannot
rot before its first Ascend run. Its preflight steps run as written (the doctor on the settings
the suite's servers use, the collection of the ``ascend`` tests with ``--device npu``); every
``python -c`` snippet in any step imports only what exists; and the job runs on the runner
``.github/ascend-runner.json`` describes, whose chips CPU CI emulates."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from examples.plumbing.profile import ascend_runner, chip_pool

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / ".github" / "workflows" / "ascend.yml"


def steps() -> list[dict]:
    return yaml.safe_load(WORKFLOW.read_text())["jobs"]["npu"]["steps"]


def python_arguments(script: str, flag: str) -> list[str]:
    """What follows every ``python <flag>`` in a step's script (``-c``: code, ``-m``: module)."""
    words = shlex.split(script.replace("\\\n", " "), comments=True)
    return [words[i + 2] for i, w in enumerate(words[:-2]) if [w, words[i + 1]] == ["python", flag]]


def test_the_job_runs_on_the_runner_whose_chips_cpu_ci_emulates():
    job = yaml.safe_load(WORKFLOW.read_text())["jobs"]["npu"]
    assert job["runs-on"] == ascend_runner()["label"]
    assert any(s.get("id", "").startswith("preflight") for s in job["steps"])
    assert chip_pool().count == ascend_runner()["chips"]


def test_every_python_snippet_imports_names_that_exist():
    """A step that runs or imports a module or name the package does not have (the workflow
    once imported a ``vllm_ascend_rl._C`` that never existed) fails here."""
    checked = 0
    for step in steps():
        for module in python_arguments(step.get("run", ""), "-m"):
            if module.startswith("vllm_ascend_rl"):
                assert importlib.util.find_spec(module), f"step {step['name']!r}: no {module}"
                checked += 1
        for code in python_arguments(step.get("run", ""), "-c"):
            for node in ast.walk(ast.parse(code)):
                if isinstance(node, ast.ImportFrom) and node.module.startswith("vllm_ascend_rl"):
                    module = __import__(node.module, fromlist=["_"])
                    for alias in node.names:
                        has = hasattr(module, alias.name)
                        assert has, f"step {step['name']!r}: {node.module} has no {alias.name}"
                        checked += 1
                elif isinstance(node, ast.Import):
                    for alias in node.names:
                        if alias.name.startswith("vllm_ascend_rl"):
                            __import__(alias.name)
                            checked += 1
    assert checked, "the workflow runs none of the package's modules"
    print(f"\n{checked} module(s) and name(s) of the package the workflow's python runs")


@pytest.mark.parametrize("step", [s for s in steps() if s.get("id", "").startswith("preflight")])
def test_a_preflight_step_passes_on_the_cpu_stack(step, report):
    """Run as the workflow runs it (``bash -e``; the runner's ``-l`` only loads the Ascend
    toolkit's environment), from the repository root, with this interpreter as ``python``."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("VLLM_ASCEND_RL_DEVICE", None)  # as on a fresh host: the doctor finds the device
    out = subprocess.run(
        ["bash", "-e", "-c", step["run"]],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    collected = re.search(r"(\d+)(?:/\d+)? tests? collected", out.stdout)
    assert collected and int(collected.group(1)) > 0, out.stdout[-2000:]
    report(f"the Ascend workflow's {step['name']} step passed on CPU: {collected.group(0)}")
