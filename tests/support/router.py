"""The router as its users start it: ``python -m vllm_ascend_rl.router`` in its own process."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import requests

from tests.support import free_port


@contextmanager
def running_router(urls: list[str], timeout_s: float = 600) -> Iterator[str]:
    """``python -m vllm_ascend_rl.router`` on a free port; killed by PID afterwards."""
    port = free_port()
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "vllm_ascend_rl.router"),
            *("--engines", ",".join(urls), "--port", str(port), "--timeout-s", str(timeout_s)),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if requests.get(url + "/router/stats", timeout=2).ok:
                    break
            except requests.ConnectionError:
                pass
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.monotonic() < deadline, "router did not come up"
            time.sleep(0.2)
        yield url
    finally:
        proc.kill()
        proc.wait(10)
