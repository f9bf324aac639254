"""Schedulers for async RL, loaded with ``--scheduler-cls``.

They are thin subclasses of vLLM's own schedulers on purpose. ``schedule()``,
``update_from_output()``, ``set_pause_state()`` and ``finish_requests()`` are inherited, never
copied, so ``/pause`` (``abort``/``wait``/``keep``), ``/resume`` and ``/is_paused`` run upstream's
code: PAUSED_ALL zeroes the token budget and PAUSED_NEW closes the waiting queue exactly as in
vLLM. vllm-ascend forked ~1,100 lines of these methods and has chased upstream drift since; a
subclass that only overrides hooks cannot drift that way.
"""

from __future__ import annotations

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler


class RecomputeScheduler(Scheduler):
    """vLLM's synchronous scheduler, the base every recompute policy hooks into.

    CPU hosts force synchronous scheduling, so this is what runs there by default.
    """


class AsyncRecomputeScheduler(AsyncScheduler, RecomputeScheduler):
    """The same policy over vLLM's ``AsyncScheduler`` (output placeholders for overlapped
    steps). It also runs correctly under synchronous stepping, so one flag works on CPU and NPU:
    ``--scheduler-cls vllm_ascend_rl.core.recompute_scheduler.AsyncRecomputeScheduler``.
    """


__all__ = ["AsyncRecomputeScheduler", "RecomputeScheduler"]
