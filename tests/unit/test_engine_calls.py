"""The stack-reading shim against vLLM's own ``EngineCore`` methods (on each vLLM leg): if
vLLM renames them or stops calling the scheduler from them, these tests fail, naming what the
plugin scheduler can no longer tell apart. The engine core is a skeleton (no model, no
executor process): only the methods under test are vLLM's; its executor is a STAND-IN."""

from __future__ import annotations

import types

from vllm.v1.core.sched.interface import PauseState
from vllm.v1.engine.core import EngineCore

from vllm_ascend_rl.core.engine_calls import engine_core_call


class RecordingScheduler:
    def __init__(self) -> None:
        self.calls = []

    def set_pause_state(self, pause_state: PauseState) -> None:
        self.calls.append((pause_state, engine_core_call(self)))


def skeleton() -> tuple[EngineCore, RecordingScheduler]:
    core = object.__new__(EngineCore)
    core.scheduler = RecordingScheduler()
    core.model_executor = types.SimpleNamespace(  # STAND-IN: an executor that is awake
        wake_up=lambda tags: None, is_sleeping=False, sleep=lambda level: None
    )
    return core, core.scheduler


def test_resume_is_seen_with_its_engine_core():
    core, sched = skeleton()
    EngineCore.resume_scheduler(core)
    ((state, call),) = sched.calls
    assert state == PauseState.UNPAUSED
    assert call.name == "resume_scheduler", "vLLM's /resume no longer reaches set_pause_state"


def test_wake_up_is_told_apart_from_resume():
    core, sched = skeleton()
    EngineCore.wake_up(core, ["weights", "kv_cache"])
    ((_, call),) = sched.calls
    assert call.name == "wake_up", "vLLM's wake_up no longer resumes through set_pause_state"
    assert call.args["tags"] == ["weights", "kv_cache"]


def test_sleep_is_seen_with_its_level():
    core, sched = skeleton()
    core.pause_scheduler = lambda mode, clear_cache: sched.set_pause_state(PauseState.PAUSED_ALL)
    EngineCore.sleep(core, level=1)
    ((_, call),) = sched.calls
    assert call.name == "sleep" and call.args["level"] == 1


def test_another_engine_cores_call_is_not_ours():
    """Data parallel: another engine core's wake_up on the stack is not this scheduler's."""
    core, sched = skeleton()
    other, _ = skeleton()
    other.scheduler = object()
    other.model_executor.wake_up = lambda tags: EngineCore.resume_scheduler(core)
    other.model_executor.is_sleeping = True  # so its own wake_up does not resume it
    EngineCore.wake_up(other, ["weights"])
    assert sched.calls[0][1].name == "resume_scheduler"
    sched.set_pause_state(PauseState.PAUSED_NEW)  # not from an engine-core call
    assert sched.calls[1][1].name is None
