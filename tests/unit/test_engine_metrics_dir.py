"""The directory through which engine workers hand their counters to the API server: one
left by a killed API server is removed by the next server's start; a live one is kept."""

from __future__ import annotations

import os
import subprocess
import tempfile

from vllm_ascend_rl.metrics import OWNER, engine_metrics_dir, remove_abandoned_dirs


def test_the_next_server_removes_only_the_directories_of_dead_servers(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()
    owners = {"killed": str(dead.pid), "live": str(os.getpid()), "being-made": None}
    for instance, pid in owners.items():
        os.makedirs(engine_metrics_dir(instance))
        if pid is not None:
            with open(os.path.join(engine_metrics_dir(instance), OWNER), "w") as f:
                f.write(pid)
    remove_abandoned_dirs()
    assert sorted(os.listdir(tmp_path)) == [
        os.path.basename(engine_metrics_dir(i)) for i in ("being-made", "live")
    ]
