"""Code run in a fresh process without a fresh interpreter's import of vLLM (seconds of CPU):
each process forks from a server that imported vLLM's plugin and factory modules and the
plugin's modules under test, and did nothing else (no plugin loaded, no chip claimed)."""

from __future__ import annotations

import contextlib
import functools
import io
import multiprocessing
import textwrap
import traceback
from multiprocessing.connection import Connection
from typing import NamedTuple

PRELOAD = [
    "vllm.plugins",
    "vllm.distributed.weight_transfer.factory",
    "vllm.device_allocator.sleep_mode_backend",
    "vllm_ascend_rl.sleep.backend",
    "npu_standin",
]


class Outcome(NamedTuple):
    returncode: int  # 0, or 1 if the code raised
    stdout: str
    stderr: str  # the traceback, if the code raised


def _exec(code: str, reply: Connection) -> None:
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(code, {"__name__": "__fresh__"})
        reply.send(Outcome(0, out.getvalue(), ""))
    except BaseException:
        reply.send(Outcome(1, out.getvalue(), traceback.format_exc()))


@functools.cache
def _context() -> multiprocessing.context.ForkServerContext:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def run_fresh(code: str, timeout_s: float = 120) -> Outcome:
    """Run ``code`` (dedented) in a fresh process; its printed output and outcome."""
    context = _context()
    mine, theirs = context.Pipe(duplex=False)
    proc = context.Process(target=_exec, args=(textwrap.dedent(code), theirs))
    proc.start()
    try:
        assert mine.poll(timeout_s), f"the fresh process did not answer within {timeout_s:g} s"
        return mine.recv()
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
