"""The plugin's figures as Prometheus counters; their names, labels and where they appear:
docs/operations.md#metrics. Each process keeps its own counters (:func:`record`); an engine
worker also writes them to its file in :func:`engine_metrics_dir`, which the API server's
``stat_logger.EngineMetricsLogger`` reads. Importing this module loads neither torch nor vLLM."""

from __future__ import annotations

import glob
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

PREFIX = "vllm_ascend_rl_"
# name -> help; every one is a counter (exposed as <PREFIX><name>_total).
HELP: dict[str, str] = {
    "weight_updates": "Weight updates by side, result (ok, refused, failed, cancelled) and cause",
    "weight_update_bytes": "Bytes of weight updates that moved (trainer: sent, engine: received)",
    "weight_update_transport_seconds": "Seconds moving update bytes (engine: waiting for "
    "buckets; trainer: start_weight_update to finish_weight_update)",
    "weight_update_load_seconds": "Seconds engine workers spent loading received buckets",
    "weight_restore_bytes": "Bytes of old weights copied back after a failed update",
    "weight_restore_seconds": "Seconds spent restoring old weights after a failed update",
    "sleeps": "Worker sleeps (/sleep) by level",
    "sleep_seconds": "Seconds workers spent going to sleep (backup and release)",
    "wakes": "Worker wakes (/wake_up)",
    "wake_seconds": "Seconds workers spent waking (map, populate, restore)",
    "pauses": "Pauses the trainer's control client asked for, by mode",
    "pause_seconds": "Seconds from /pause sent to /pause answered (the pause is complete)",
    "router_requests": "Completion requests the router sent, by engine (resends included)",
    "router_resends": "Bounced completions the router resent to an engine",
}

Labels = tuple[tuple[str, str], ...]
Row = tuple[tuple[str, Labels], float]  # ((name, labels), value), as in values().items()

_lock = threading.Lock()
_values: dict[tuple[str, Labels], float] = {}
_snapshot: str | None = None  # this engine worker's file, once engine_worker() has run


def record(counts: dict[str, float], **labels: str) -> None:
    """Add ``counts`` (name -> amount) to this process's counters under ``labels``."""
    key = tuple(sorted(labels.items()))
    with _lock:
        for name, amount in counts.items():
            if name not in HELP:
                raise KeyError(f"unknown metric {name!r}")
            _values[(name, key)] = _values.get((name, key), 0.0) + amount
        # No directory: no API server collects them (offline LLM, or before it is up).
        if _snapshot is not None and os.path.isdir(os.path.dirname(_snapshot)):
            tmp = f"{_snapshot}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump([[n, dict(pairs), v] for (n, pairs), v in _values.items()], f)
            os.replace(tmp, _snapshot)


def values() -> dict[tuple[str, Labels], float]:
    with _lock:
        return dict(_values)


def engine_metrics_dir(instance_id: str) -> str:
    """Where an engine's workers leave their counters for its API server (both know the
    ``instance_id`` of the vLLM config they share)."""
    return os.path.join(tempfile.gettempdir(), f"vllm_ascend_rl-metrics-{instance_id}")


OWNER = "owner.pid"  # the API server that made the directory


def remove_abandoned_dirs() -> None:
    """Remove the directories of API servers that are gone without their exit handlers
    (killed): the next server on the host cleans up after them."""
    for directory in glob.glob(engine_metrics_dir("*")):
        try:
            with open(os.path.join(directory, OWNER)) as f:
                os.kill(int(f.read()), 0)
        except ProcessLookupError:
            shutil.rmtree(directory, ignore_errors=True)
        except (OSError, ValueError):
            pass  # being made, or another user's live server


def engine_worker(vllm_config: Any, worker: int) -> None:
    """Mark this process as engine worker ``worker`` of ``vllm_config``'s engine: from now on
    every :func:`record` also updates its file, if the API server made the directory."""
    global _snapshot
    instance = getattr(vllm_config, "instance_id", "")
    if instance:
        _snapshot = os.path.join(engine_metrics_dir(instance), f"worker-{worker}.json")


def engine_rows(directory: str) -> Iterator[Row]:
    """Every worker file in ``directory``, each series labelled with its ``worker``."""
    for path in sorted(glob.glob(os.path.join(directory, "worker-*.json"))):
        worker = os.path.basename(path)[len("worker-") : -len(".json")]
        try:
            with open(path) as f:
                rows = json.load(f)
        except (OSError, ValueError):
            continue  # a worker that died mid-write: its last whole file is gone too
        for name, labels, v in rows:
            yield (name, tuple(sorted({**labels, "worker": worker}.items()))), v


class Collector:
    """A prometheus_client collector over rows (:data:`Row`)."""

    def __init__(self, rows: Callable[[], Iterable[Row]]) -> None:
        self.rows = rows

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        series: dict[str, list[tuple[dict[str, str], float]]] = {}
        for (name, pairs), v in self.rows():
            if name in HELP:
                series.setdefault(name, []).append((dict(pairs), v))
        for name, samples in sorted(series.items()):
            keys = sorted({k for labels, _ in samples for k in labels})
            family = CounterMetricFamily(PREFIX + name, HELP[name], labels=keys)
            for labels, v in samples:
                family.add_metric([labels.get(k, "") for k in keys], v)
            yield family

    def describe(self) -> list[Any]:
        return []  # unknown until scraped: no name clash check at registration


_registered: set[int] = set()


def register_trainer_metrics(registry: Any = None) -> None:
    """Expose this process's counters (trainer engines, control client) in ``registry``
    (prometheus_client's default registry if None); a second call for a registry does nothing."""
    from prometheus_client import REGISTRY

    registry = REGISTRY if registry is None else registry
    if id(registry) not in _registered:
        registry.register(Collector(lambda: values().items()))
        _registered.add(id(registry))
