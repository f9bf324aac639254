"""Noise-proof comparisons for the benchmarks.

A busy 2-core host moves a single timing by tens of percent, which is more than most targets
allow. So every comparison here is measured the same way:

- the compared variants run **interleaved**, round after round, and each round starts with a
  different variant, so a slow spell of the host hits every variant alike;
- at least 5 rounds (after a warm-up round that is not counted);
- a ratio is taken **per round** (the two variants measured back to back), and the report
  gives the median ratio and its spread (half the range of the per-round ratios);
- a target fails only when the median misses it by more than the spread: a miss within the
  spread is reported as such ("within noise"), never as met.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TypeVar

MIN_ROUNDS = 5
K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


def interleaved(
    variants: dict[K, Callable[[], T]], rounds: int = MIN_ROUNDS, warmup: int = 1
) -> dict[K, list[T]]:
    """Run every variant once per round, each round starting one variant later; return
    each variant's measurements of the counted rounds (``warmup`` rounds are dropped)."""
    if rounds < MIN_ROUNDS:
        raise ValueError(f"at least {MIN_ROUNDS} rounds, got {rounds}")
    names = list(variants)
    out: dict[K, list[T]] = {n: [] for n in names}
    for r in range(warmup + rounds):
        for i in range(len(names)):
            name = names[(r + i) % len(names)]
            value = variants[name]()
            if r >= warmup:
                out[name].append(value)
    return out


def median(values: list[float]) -> float:
    return statistics.median(values)


def spread(values: list[float]) -> float:
    """Half the range: how far one round may stray from another."""
    return (max(values) - min(values)) / 2 if values else 0.0


@dataclass
class Target:
    """``numerator / denominator`` per round must be <= ``limit`` (or >= with ``at_least``)."""

    label: str
    per_round: list[float]
    limit: float
    at_least: bool = False

    @classmethod
    def of(
        cls,
        label: str,
        numerator: list[float],
        denominator: list[float],
        limit: float,
        at_least: bool = False,
    ) -> Target:
        ratios = [n / d for n, d in zip(numerator, denominator, strict=True)]
        return cls(label, ratios, limit, at_least)

    @property
    def median(self) -> float:
        return median(self.per_round)

    @property
    def spread(self) -> float:
        return spread(self.per_round)

    @property
    def miss(self) -> float:
        """How far the median is on the wrong side of the limit (<= 0: met)."""
        return self.limit - self.median if self.at_least else self.median - self.limit

    @property
    def verdict(self) -> str:
        if self.miss <= 0:
            return "met"
        return "missed within noise" if self.miss <= self.spread else "NOT met"

    @property
    def failed(self) -> bool:
        return self.verdict == "NOT met"

    def line(self) -> str:
        sign = ">=" if self.at_least else "<="
        return (
            f"target {self.label} {sign} {self.limit:g}: median {self.median:.3f} "
            f"(spread ±{self.spread:.3f}, {len(self.per_round)} rounds): {self.verdict}"
        )


def report(targets: list[Target]) -> int:
    """Print every verdict; the exit status: 1 if a target failed beyond its spread."""
    print()
    for t in targets:
        print(t.line())
    return 1 if any(t.failed for t in targets) else 0
