"""Which of vLLM's engine-core calls is changing the scheduler's state.

vLLM's engine core restarts scheduling the same way for ``/resume`` and for ``/wake_up``: both
end in ``scheduler.set_pause_state(UNPAUSED)``. So a resume cannot know that the engine is
asleep (the next step would run on released memory and kill the engine core), and a wake drops
a pause the trainer took before the engine slept. The scheduler can tell them apart by the
engine-core method that called it: ``sleep``, ``wake_up`` and ``release_kv_cache_memory`` are
the names the engine-core client invokes as utility calls (``core_client.py``), the same in
vLLM 0.27.1 and 0.32, so they are part of vLLM's engine protocol, not an implementation detail.
"""

from __future__ import annotations

import sys
from typing import Any

ENGINE_CORE_CALLS = frozenset({"sleep", "wake_up", "release_kv_cache_memory"})
_MAX_DEPTH = 6  # set_pause_state <- pause_scheduler/resume_scheduler/_reset_caches <- the call


def engine_core_call(scheduler: Any) -> tuple[str | None, dict[str, Any]]:
    """The engine-core call (one of :data:`ENGINE_CORE_CALLS`) that is running on the
    engine that owns ``scheduler`` and led to the current scheduler method, with its
    arguments; ``(None, {})`` for any other caller (``/pause``, ``/resume``, a step)."""
    frame = sys._getframe(2)  # skip this function and the scheduler method that asked
    for _ in range(_MAX_DEPTH):
        if frame is None:
            break
        name = frame.f_code.co_name
        if name in ENGINE_CORE_CALLS:
            owner = frame.f_locals.get("self")
            if getattr(owner, "scheduler", None) is scheduler:
                return name, frame.f_locals
        frame = frame.f_back
    return None, {}
