"""Waiting for token counts to settle. The request helpers are defined in
``examples/plumbing/streams.py`` and re-exported here."""

from __future__ import annotations

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
