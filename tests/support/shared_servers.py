"""Servers that several test modules use, started once per session: a vLLM server start costs
about 30 s of CPU on the CI host, and start-ups side by side overlap their waits. A user leaves
a shared server as it found it (resumed, awake, on its start-up weights); one that a test
killed is started again on the next request."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from examples.plumbing import VLLMServer

# The shared RL engine that runs in vLLM's default compile mode (ACL graphs on Ascend), with a
# reference of its own on v2 in that mode: compiled kernels round differently from eager ones,
# and a tiny random model's greedy continuations part after a few dozen tokens.
GRAPHS_BACKEND = "ascend_rl_npu_ipc"
RL_BACKENDS = ("ascend_rl_hccl", "ascend_rl_npu_ipc")
# Every shared server, one chip each (tests/conftest.py builds exactly these), in two groups:
# the eager ones start on the session's first request; the compile-mode pair with them when a
# collected module says it uses the pair (USES_COMPILE_MODE_PAIR), else on its first request
# (a selection without the NPU-IPC engine's suites never starts it).
EAGER = ("reference-v1", "reference-v2", *(f"rl-{b}" for b in RL_BACKENDS if b != GRAPHS_BACKEND))
GRAPHS = ("reference-v2-graphs", f"rl-{GRAPHS_BACKEND}")
SHARED = (*EAGER, *GRAPHS)


class SharedServers:
    """``makers``: name -> a function of the log path that builds the server (not started)."""

    def __init__(
        self, log_dir: Path, makers: dict[str, Callable[[Path], VLLMServer]], with_graphs: bool
    ) -> None:
        self.log_dir, self.makers, self.with_graphs = log_dir, makers, with_graphs
        self._servers: dict[str, VLLMServer] = {}

    def get(self, name: str) -> VLLMServer:
        """The started server ``name``, healthy; one found dead is started again."""
        if not self._servers:
            self._launch(EAGER + GRAPHS if self.with_graphs else EAGER)
        if name in GRAPHS and not self._servers.keys() & set(GRAPHS):
            self._launch(GRAPHS)
        server = self._servers.get(name)
        if server is not None and server.came_up and not server.is_healthy():  # it died since
            del self._servers[name]
            server.stop()
        self._launch((name,))
        server = self._servers[name]
        if not server.came_up:
            server.wait_healthy()
        return server

    def discard(self, server: VLLMServer) -> None:
        """Stop ``server`` (one a user could not leave as it found it); ``get`` starts anew."""
        for name, known in list(self._servers.items()):
            if known is server:
                del self._servers[name]
        server.stop()

    def close(self) -> None:
        for server in self._servers.values():
            server.stop()
        self._servers.clear()

    def _launch(self, names: tuple[str, ...]) -> None:
        """Start those of ``names`` not started yet, side by side, not waiting for them."""
        for name in names:
            if name not in self._servers:
                self._servers[name] = self.makers[name](self.log_dir / f"{name}.log")
                self._servers[name].start(wait=False)
