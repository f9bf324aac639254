"""Which engine-core call is changing the scheduler's pause state; the only code that reads the
call stack. ``/resume`` and ``/wake_up`` both end in ``scheduler.set_pause_state(UNPAUSED)``
(``EngineCore.resume_scheduler``, which ``wake_up`` calls) and the scheduler is never told about
sleep, so it looks up the stack for the utility method the engine-core client invoked by name
(``core_client.py``, the same in vLLM 0.27.1 and 0.32). ``tests/unit/test_engine_calls.py``
runs vLLM's own ``EngineCore`` through this on both releases. An upstream hook would remove it:
the engine core telling the scheduler why its pause state changes (sleep, wake, resume)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from itertools import islice
from traceback import walk_stack
from typing import Any

ENGINE_CORE_CALLS = frozenset({"sleep", "wake_up", "resume_scheduler"})
_MAX_DEPTH = 8  # set_pause_state <- resume_scheduler (DP, then base) <- wake_up <- ...


@dataclass
class EngineCoreCall:
    """The outermost engine-core call running on the engine that owns the scheduler."""

    name: str | None = None  # one of ENGINE_CORE_CALLS, or None (/pause, a test)
    args: dict[str, Any] = field(default_factory=dict)  # that call's local variables


def engine_core_call(scheduler: Any) -> EngineCoreCall:
    """The engine-core call that led to the scheduler method asking (its caller's caller)."""
    found = EngineCoreCall()
    callers = walk_stack(sys._getframe(2))  # above this function and the scheduler's method
    for frame, _ in islice(callers, _MAX_DEPTH):
        owner = frame.f_locals.get("self")
        name = frame.f_code.co_name
        if name in ENGINE_CORE_CALLS and getattr(owner, "scheduler", None) is scheduler:
            found = EngineCoreCall(name, dict(frame.f_locals))
    return found
