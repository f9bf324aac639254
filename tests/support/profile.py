"""Where the tests' trainer processes run. The device profile and the chip pool the servers
take their chips from are defined in ``examples/plumbing/profile.py`` and re-exported here."""

from __future__ import annotations

from collections.abc import Sequence

from examples.plumbing.profile import (  # noqa: F401  (re-exported)
    ChipPool,
    chip_pool,
    current_profile,
    engine_chip_list,
    trainer_chip,
)


def trainer_env(
    engine_chips: Sequence[int] | int, colocated: bool, rank: int = 0
) -> dict[str, str]:
    """A trainer rank's environment: it puts the process on :func:`trainer_chip`. (A CPU
    trainer rank ``r`` emulates logical chip ``r``: colocated, it sees its engine's chips.)"""
    profile = current_profile()
    if profile.kind != "npu":
        return profile.chips_env(engine_chip_list(engine_chips)) if colocated else {}
    return profile.chips_env([trainer_chip(engine_chips, colocated, rank)])
