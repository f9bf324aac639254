"""``.github/workflows/ascend.yml`` on CPU: what needs no NPU runs here, so the workflow cannot
rot before its first Ascend run. Its preflight steps run as written (the doctor on the settings
the suite's servers use, the collection of the ``ascend`` tests with ``--device npu``); every
``python -c`` snippet in any step imports only what exists; the job runs only where a runner
is attached, in the release image of a supported stack, with the chips
``.github/ascend-runner.json`` describes, which CPU CI emulates."""

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
from vllm_ascend_rl import stacks

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / ".github" / "workflows" / "ascend.yml"


def steps() -> list[dict]:
    return yaml.safe_load(WORKFLOW.read_text())["jobs"]["npu"]["steps"]


def python_arguments(script: str, flag: str) -> list[str]:
    """What follows every ``python <flag>`` in a step's script (``-c``: code, ``-m``: module)."""
    words = shlex.split(script.replace("\\\n", " "), comments=True)
    return [words[i + 2] for i, w in enumerate(words[:-2]) if [w, words[i + 1]] == ["python", flag]]


def test_the_job_runs_only_on_an_attached_runner_with_the_chips_cpu_ci_emulates():
    job = yaml.safe_load(WORKFLOW.read_text())["jobs"]["npu"]
    assert job["runs-on"] == "${{ vars.ASCEND_RUNNER }}"
    assert job["if"] == "vars.ASCEND_RUNNER != ''"  # else skipped, on demand and on schedule
    assert any(s.get("id", "").startswith("preflight") for s in job["steps"])
    options = job["container"]["options"].split()
    devices = [options[i + 1] for i, o in enumerate(options) if o == "--device"]
    chips = ascend_runner()["chips"]
    assert [d for d in devices if re.fullmatch(r"/dev/davinci\d+", d)] == [
        f"/dev/davinci{n}" for n in range(chips)
    ]
    driver = {"/dev/davinci_manager", "/dev/devmm_svm", "/dev/hisi_hdc"}
    assert driver <= set(devices)
    assert "/usr/local/Ascend/driver/lib64/:/usr/local/Ascend/driver/lib64/" in options
    assert chip_pool().count == chips


def test_the_job_runs_in_the_release_image_of_a_supported_stack():
    image = yaml.safe_load(WORKFLOW.read_text())["jobs"]["npu"]["container"]["image"]
    assert image in {f"quay.io/ascend/vllm-ascend:v{s.vllm_ascend}" for s in stacks.SUPPORTED}


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
