"""``python -m vllm_ascend_rl.doctor`` (or ``vllm-ascend-rl-doctor``): check, before a run,
that this host's stack, the plugin's registration, the environment, and any running servers
(``--engine URL``) are what the plugin needs. Each check says ``ok``, ``warn``, ``fail`` or
``skipped`` with what it found and the fix; the exit code is 1 if any check failed.

The checks: :mod:`.local` (stack, registration, environment) and :mod:`.engines` (HTTP); the
command line: :mod:`.cli`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Status = Literal["ok", "warn", "fail", "skipped"]


@dataclass(frozen=True)
class Check:
    """One check's outcome: ``found`` says what it saw, ``fix`` what to do (empty if ok)."""

    area: str
    name: str
    status: Status
    found: str
    fix: str = ""


def ok(area: str, name: str, found: str) -> Check:
    return Check(area, name, "ok", found)


def warn(area: str, name: str, found: str, fix: str) -> Check:
    return Check(area, name, "warn", found, fix)


def fail(area: str, name: str, found: str, fix: str) -> Check:
    return Check(area, name, "fail", found, fix)


def ok_or_fail(area: str, name: str, passed: bool, found: str, fix: str) -> Check:
    return ok(area, name, found) if passed else fail(area, name, found, fix)


def skipped(area: str, name: str) -> Check:
    return Check(area, name, "skipped", "skipped (no NPU)")
