"""Holding generation while a worker's weights are not whole (``on_failure="hold"``).

In hold mode a weight update keeps no copy of the old weights. The model is whole again only
when an update completes. From ``start_weight_update`` until then, the scheduler must not let
a step run: not during the update, and not after a failed one that left a mix of versions. The
worker and the scheduler are separate processes. So the driver worker of each data-parallel
engine publishes why generation must wait, as a small file under ``/dev/shm`` keyed by the
engine core's process id. The plugin scheduler reads it before every step and before any resume.
The file exists only while generation is held: it is removed when an update completes and when
the worker exits. A hold may lapse: the hold of an update that was started but never got to
``update_weights`` (its trainer died) ends after ``timeout_s``. The model is still whole then,
and the first forward pass ends the abandoned update (the engine's forward guard).
"""

from __future__ import annotations

import atexit
import os
import tempfile
import time
from pathlib import Path
from typing import Any

HOLD_DIR = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(tempfile.gettempdir())


def engine_pid(vllm_config: Any, in_worker: bool) -> int:
    """The engine core's process id: the key the engine core and its workers share.

    vLLM's config carries no id that stays the same in both (``instance_id`` is regenerated
    whenever the config is re-validated). Workers of the ``mp`` executor are spawned by the
    engine core; the ``uni`` executor runs the worker inside it. Other executors (Ray, an
    external launcher) may run workers on other hosts: hold mode is refused there.
    """
    if in_worker and vllm_config.parallel_config.distributed_executor_backend == "mp":
        return os.getppid()
    return os.getpid()


def hold_path(vllm_config: Any, in_worker: bool = False) -> Path:
    dp = vllm_config.parallel_config.data_parallel_index
    pid = engine_pid(vllm_config, in_worker)
    return HOLD_DIR / f"vllm_ascend_rl_hold-{os.getuid()}-{pid}-dp{dp}"


def hold_supported(vllm_config: Any) -> str | None:
    """Why hold mode cannot work with this engine's executor, or None."""
    backend = vllm_config.parallel_config.distributed_executor_backend
    if backend in ("mp", "uni"):
        return None
    return (
        f"on_failure='hold' needs the engine's workers on the engine core's host, spawned by "
        f"it (executor 'mp' or 'uni'; this engine uses {backend!r}): use on_failure='restore'"
    )


LAPSES = "lapses at "  # first line of a hold that ends by itself: "lapses at <unix time>"


def hold_state(vllm_config: Any) -> tuple[str | None, float | None]:
    """(why generation must wait, or None when it may run; when that hold lapses, or None)."""
    try:
        text = hold_path(vllm_config).read_text()
    except OSError:
        return None, None
    lapses_at = None
    if text.startswith(LAPSES):
        first, _, text = text.partition("\n")
        try:
            lapses_at = float(first.removeprefix(LAPSES))
        except ValueError:
            pass
        if lapses_at is not None and time.time() >= lapses_at:
            return None, None
    return text or "the weights are not whole", lapses_at


def read_hold(vllm_config: Any) -> str | None:
    """Why generation must wait, or None when it may run."""
    return hold_state(vllm_config)[0]


class HoldPublisher:
    """The worker side. Only the engine's driver worker publishes (``enabled``); nothing is
    computed or written before the first hold."""

    def __init__(self, vllm_config: Any, enabled: bool) -> None:
        self.vllm_config = vllm_config
        self.enabled = enabled
        self.path: Path | None = None  # set by the first hold

    def hold(self, reason: str, lapses_after_s: float | None = None) -> None:
        """Hold generation for ``reason``; for ``lapses_after_s`` seconds only, if given."""
        if not self.enabled:
            return
        if self.path is None:
            self.path = hold_path(self.vllm_config, in_worker=True)
            atexit.register(self.release)
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            if lapses_after_s is not None:
                f.write(f"{LAPSES}{time.time() + lapses_after_s:.3f}\n")
            f.write(reason)
        os.replace(tmp, self.path)

    def release(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)
