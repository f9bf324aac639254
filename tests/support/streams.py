"""Waiting for token counts to settle. The request helpers are defined in
``examples/plumbing/streams.py`` and re-exported here."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from examples.plumbing.streams import (  # noqa: F401  (re-exported)
    StreamingCompletion,
    greedy_token_ids,
)

T = TypeVar("T")


def settled(read: Callable[[], T], quiet_s: float = 0.3, timeout_s: float = 10) -> T:
    """``read()`` (token counts) once it has not changed for ``quiet_s``: on a paused engine,
    the chunks still in transit have arrived. Raises if it keeps changing for ``timeout_s``."""
    last, quiet_since = read(), time.monotonic()
    deadline = quiet_since + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.02)
        now = read()
        if now != last:
            last, quiet_since = now, time.monotonic()
        elif time.monotonic() - quiet_since >= quiet_s:
            return now
    raise AssertionError(f"token counts did not settle within {timeout_s} s: {last}")
