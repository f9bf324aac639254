"""The doctor's command line: run the checks, print a table or JSON, exit 1 on a ``fail``."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from dataclasses import asdict

from vllm_ascend_rl import doctor
from vllm_ascend_rl.doctor import Check, engines, local


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
    summary = doctor.__doc__.split("\n")[0]
    ap = argparse.ArgumentParser(prog="vllm-ascend-rl-doctor", description=summary)
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
    ap.add_argument(
        "--additional-config",
        type=json.loads,
        default=None,
        metavar="JSON",
        help="the --additional-config your servers start with (on NPU the NZ and "
        "PYTORCH_NPU_ALLOC_CONF checks judge what vllm-ascend makes of it)",
    )
    ap.add_argument("--json", action="store_true", help="print the checks as JSON")
    args = ap.parse_args(argv)
    with contextlib.redirect_stdout(sys.stderr):  # vLLM logs to stdout
        checks = local.checks(args.timeout_s, args.additional_config)
        checks += engines.checks(args.engine, timeout_s=60.0)
    print(json.dumps([asdict(c) for c in checks], indent=1) if args.json else render(checks))
    return 1 if any(c.status == "fail" for c in checks) else 0


def console() -> None:
    sys.exit(main())
