"""``EngineMetricsLogger``: the ``vllm.stat_logger_plugins`` entry point that puts the engine
workers' counters (:mod:`vllm_ascend_rl.metrics`) on the API server's ``/metrics``.

vLLM builds stat-logger plugins in the API server process only (``AsyncLLM``), with the
config its workers got; it logs nothing per step. As a side effect of any stat-logger
plugin, vLLM collects its own statistics even under ``--disable-log-stats``. With
``--api-server-count`` > 1, vLLM serves ``/metrics`` from its multiprocess registry, which
holds no custom collector: the engine's counters are then not exposed."""

from __future__ import annotations

import atexit
import os
import shutil

from vllm.v1.metrics.loggers import StatLoggerBase

from vllm_ascend_rl.logs import get_logger
from vllm_ascend_rl.metrics import (
    OWNER,
    Collector,
    engine_metrics_dir,
    engine_rows,
    remove_abandoned_dirs,
)

logger = get_logger(__name__)

_serving: set[str] = set()


def serve_engine_metrics(instance_id: str) -> None:
    """Create the workers' directory and read it on every scrape; removed at exit."""
    from prometheus_client import REGISTRY
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    if not instance_id or instance_id in _serving:
        return
    _serving.add(instance_id)
    if get_prometheus_registry() is not REGISTRY:
        logger.warning("vllm_ascend_rl metrics are not on /metrics with --api-server-count > 1")
        return
    remove_abandoned_dirs()
    directory = engine_metrics_dir(instance_id)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, OWNER), "w") as f:
        f.write(str(os.getpid()))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    REGISTRY.register(Collector(lambda: engine_rows(directory)))


class EngineMetricsLogger(StatLoggerBase):
    def __init__(self, vllm_config, engine_index: int = 0) -> None:
        serve_engine_metrics(getattr(vllm_config, "instance_id", ""))

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
        pass

    def log_engine_initialized(self) -> None:
        pass
