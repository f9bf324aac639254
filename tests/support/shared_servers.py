"""Servers that several test modules use, started once per session: a vLLM server start costs
about 30 s of CPU on the CI host. A user leaves a shared server as it found it (resumed, awake,
on its start-up weights); one that a test killed is started again on the next request."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from examples.plumbing import VLLMServer


class SharedServers:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self._servers: dict[str, VLLMServer] = {}

    def get(self, name: str, make: Callable[[Path], VLLMServer]) -> VLLMServer:
        """The started server called ``name``; ``make(log_path)`` builds it on first use."""
        server = self._servers.get(name)
        if server is not None and not server.is_healthy():
            server.stop()
            server = None
        if server is None:
            server = self._servers[name] = make(self.log_dir / f"{name}.log")
            server.start()
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
