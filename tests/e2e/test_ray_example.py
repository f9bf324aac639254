"""``examples/rlhf_ray_hccl.py`` on a local Ray cluster: a trainer actor, two in-process vLLM
engines (``AsyncLLM``) in one placement group, one sync to both while their requests are
paused mid-stream, validated against vLLM's own load of the new weights into one of them. The
example asserts and prints its own validation; this runs it as a user would and checks what it
printed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.profile import chip_pool, current_profile

pytest.importorskip("ray", reason="the ray extra is not installed (pip install '.[ray]')")

pytestmark = [pytest.mark.e2e, pytest.mark.ascend, pytest.mark.timeout(900)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rlhf_ray_hccl.py"


def test_ray_example_syncs_two_engines_and_validates(request, tmp_path):
    """On NPU its actors take three chips of the suite's pool (Ray hands out only the chips
    ``ASCEND_RT_VISIBLE_DEVICES`` shows it), each engine the suite's share of its chip."""
    device, profile, env = request.config.getoption("--device"), current_profile(), {}
    command = [sys.executable, str(EXAMPLE), "--device", device]
    if device == "npu":
        if chip_pool().count < 3:
            pytest.skip("needs 3 NPUs: the trainer and each engine take one (one HCCL rank a chip)")
        env = profile.chips_env(profile.take_chips(request.node, 3))
        command += ["--gpu-memory-utilization", profile.memory_fraction]
    log = tmp_path / "ray-example.log"
    try:
        with open(log, "wb") as out:
            proc = subprocess.run(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=800,
                cwd=EXAMPLE.parents[1],
                env={**os.environ, **env},
            )
    finally:
        profile.give_back_chips(request.node)
    text = log.read_text(errors="replace")
    assert proc.returncode == 0, text[-4000:]
    assert "trainer connected to both engines" in text
    assert "8/8 continuations equal vLLM's own load of v2" in text
    assert "validated: every request continued exactly on the new weights" in text
    print("\n" + next(line for line in text.splitlines() if line.startswith("pause ")))
