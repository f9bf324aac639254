"""Waiting for token counts to settle. The request helpers are defined in
``examples/plumbing/streams.py`` and re-exported here."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import requests

from examples.plumbing.streams import (  # noqa: F401  (re-exported)
    StreamingCompletion,
    greedy_token_ids,
)

T = TypeVar("T")


def settled(
    read: Callable[[], T],
    urls: str | Sequence[str],
    quiet_s: float = 0.3,
    timeout_s: float = 10,
    round_trips: int = 3,
) -> T:
    """``read()`` (token counts) once it has not changed for ``quiet_s`` nor while each server
    in ``urls`` answered ``round_trips`` ``/health`` requests.

    ``/pause`` can answer while the API server's output handler still holds tokens generated
    before the pause (vLLM only sleeps 20 ms, for "more intuitive ordering"); on a starved host
    they reach the streams later than any fixed quiet time. ``/health`` is served by the same
    event loop, so answers after the last change show the server has run past those outputs.
    Raises if the counts keep changing for ``timeout_s``."""
    urls = [urls] if isinstance(urls, str) else list(urls)
    last, quiet_since, trips = read(), time.monotonic(), 0
    deadline = quiet_since + timeout_s
    while time.monotonic() < deadline:
        for url in urls:
            requests.get(url.rstrip("/") + "/health", timeout=timeout_s).raise_for_status()
        time.sleep(0.02)
        now = read()
        if now != last:
            last, quiet_since, trips = now, time.monotonic(), 0
            continue
        trips += 1
        if trips >= round_trips and time.monotonic() - quiet_since >= quiet_s:
            return now
    raise AssertionError(f"token counts did not settle within {timeout_s} s: {last}")


class TokenClock:
    """Streams completions back to back in a thread (each to its length limit) and records
    when every token arrived: :meth:`longest_gap` shows whether generation ever stopped."""

    def __init__(self, url: str, prompt: str = "The clock says", max_tokens: int = 256) -> None:
        self.url, self.prompt, self.max_tokens = url, prompt, max_tokens
        self.error: str | None = None
        self.streams: list[StreamingCompletion] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="token-clock")

    def _run(self) -> None:
        while not self._stop.is_set():
            stream = StreamingCompletion(self.url, self.prompt, self.max_tokens, ignore_eos=True)
            self.streams.append(stream)
            stream.run()  # in this thread
            if not stream.ok:
                self.error = stream.error or f"finish_reason={stream.finish_reason}"
                return

    def times(self) -> list[float]:
        return [t for s in list(self.streams) for t in list(s.token_times)]

    def __enter__(self) -> TokenClock:
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self.times():
            assert self.error is None and time.monotonic() < deadline, self.error or "no token"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60)

    def longest_gap(self, since: float) -> float:
        """The longest time without a token from ``since`` (monotonic) to now."""
        assert self.error is None, f"the clock's stream failed: {self.error}"
        stamps = [since, *(t for t in self.times() if t > since), time.monotonic()]
        return max(b - a for a, b in itertools.pairwise(stamps))
