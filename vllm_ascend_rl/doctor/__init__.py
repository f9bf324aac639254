"""``python -m vllm_ascend_rl.doctor`` (or ``vllm-ascend-rl-doctor``): check, before a run,
that this host's stack, the plugin's registration, the environment, and any running servers
(``--engine URL``) are what the plugin needs. Each check says ``ok``, ``warn``, ``fail`` or
``skipped`` with what it found and the fix; the exit code is 1 if any check failed.

The checks: :mod:`.local` (stack, registration, environment) and :mod:`.engines` (HTTP)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from typing import Literal

Status = Literal["ok", "warn", "fail", "skipped"]
NO_NPU = "skipped (no NPU)"


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


def skipped(area: str, name: str, why: str = NO_NPU) -> Check:
    return Check(area, name, "skipped", why)


def run(engines: list[str], timeout_s: float, http_timeout_s: float = 10.0) -> list[Check]:
    from vllm_ascend_rl.doctor import engines as remote
    from vllm_ascend_rl.doctor import local

    return [*local.checks(timeout_s), *remote.checks(engines, http_timeout_s)]


def render(checks: list[Check]) -> str:
    """A plain-text table, a fix line under each check that is not ok."""
    width = max(len(f"{c.area}: {c.name}") for c in checks)
    lines = []
    for c in checks:
        status = "skipped" if c.status == "skipped" else c.status.upper()
        lines.append(f"{status:<8} {f'{c.area}: {c.name}':<{width}}  {c.found}")
        if c.fix:
            lines.append(f"{'':<8} {'':<{width}}  fix: {c.fix}")
    counts = {s: sum(c.status == s for c in checks) for s in ("ok", "warn", "fail", "skipped")}
    lines.append(", ".join(f"{n} {s}" for s, n in counts.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="vllm-ascend-rl-doctor", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="URL",
        help="a running vLLM server to check over HTTP (repeatable; several are compared)",
    )
    ap.add_argument(
        "--timeout-s",
        type=float,
        default=120.0,
        help="the timeout_s your weight-transfer init passes (default: the plugin's, 120)",
    )
    ap.add_argument("--json", action="store_true", help="print the checks as JSON")
    args = ap.parse_args(argv)
    checks = run(args.engine, args.timeout_s)
    if args.json:
        print(json.dumps([asdict(c) for c in checks], indent=1))
    else:
        print(render(checks))
    return 1 if any(c.status == "fail" for c in checks) else 0


def console() -> None:
    sys.exit(main())
