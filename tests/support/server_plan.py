"""Module servers, started one module ahead. A vLLM server start costs about 20 s, mostly
of one core, and a module's tests leave about half of the CI host's two cores idle: so while
one module runs, the next module's servers start, at a lower priority than the tests.

A test module lists the functions that build its servers in ``SERVERS``; each takes a log
directory of its own and returns the servers, not started. Its fixture takes them with
``server_plan.serving(maker)``. The plan's order is the collected tests' order."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import psutil

from examples.plumbing import VLLMServer

Maker = Callable[[Path], Sequence[VLLMServer]]

PREFETCH_NICENESS = 10  # a starting server yields to the running module's tests


def restore_priority(server: VLLMServer) -> None:
    """Give a prefetched server the priorities of one started now: its API server 0, its
    engine processes the profile's. (Lowering a niceness needs CAP_SYS_NICE; without it
    the server keeps the lower priority.)"""
    with contextlib.suppress(psutil.Error):
        api_server = psutil.Process(server.proc.pid)
        api_server.nice(0)
        for child in api_server.children(recursive=True):
            child.nice(server.profile.engine_niceness)


class ServerPlan:
    def __init__(self, log_dir: Path, order: Sequence[Maker], prefetch: bool) -> None:
        self.log_dir, self.order, self.prefetch = log_dir, list(order), prefetch
        self._started: dict[Maker, Sequence[VLLMServer]] = {}

    @contextmanager
    def serving(self, make: Maker) -> Iterator[Sequence[VLLMServer]]:
        """``make``'s servers, healthy, until the block ends; then stopped. Starts the next
        maker's servers in the background (on a CPU host)."""
        prefetched = self._started.pop(make, None)
        servers = prefetched or self._start(make)
        self.close()  # anything else started ahead was for a module that did not run
        self._start_next(make)
        try:
            for server in servers:
                server.wait_healthy()
                if prefetched:
                    restore_priority(server)
            yield servers
        finally:
            self._stop(servers)

    def close(self) -> None:
        """Stop the servers started ahead."""
        for servers in self._started.values():
            self._stop(servers)
        self._started.clear()

    def _start(self, make: Maker, niceness: int = 0) -> Sequence[VLLMServer]:
        log_dir = self.log_dir / make.__name__
        log_dir.mkdir(exist_ok=True)
        servers = make(log_dir)
        for server in servers:
            server.start(wait=False)
            if niceness:  # its engine processes, not spawned yet, inherit it
                psutil.Process(server.proc.pid).nice(niceness)
        return servers

    def _start_next(self, make: Maker) -> None:
        if not self.prefetch or make not in self.order:
            return
        at = self.order.index(make) + 1
        if at < len(self.order):
            self._started[self.order[at]] = self._start(self.order[at], PREFETCH_NICENESS)

    @staticmethod
    def _stop(servers: Sequence[VLLMServer]) -> None:
        for server in servers:
            server.stop()
