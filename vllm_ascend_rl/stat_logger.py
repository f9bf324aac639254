"""``EngineMetricsLogger``: the ``vllm.stat_logger_plugins`` entry point that puts the engine
workers' counters (:mod:`vllm_ascend_rl.metrics`) on the API server's ``/metrics``. vLLM builds
it in the API server process only (``AsyncLLM``), with the config its workers got; it logs
nothing per step. Its side effects and limits (``--disable-log-stats``, ``--api-server-count``
> 1): docs/operations.md#metrics."""

from __future__ import annotations

import atexit
import os
import shutil
from typing import TYPE_CHECKING, Any

from vllm.v1.metrics.loggers import StatLoggerBase

from vllm_ascend_rl import metrics
from vllm_ascend_rl.logs import get_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = get_logger(__name__)

_serving: set[str] = set()


class EngineMetricsLogger(StatLoggerBase):
    def __init__(self, vllm_config: VllmConfig, engine_index: int = 0) -> None:
        """Create the workers' directory and read it on every scrape; removed at exit."""
        from prometheus_client import REGISTRY
        from vllm.v1.metrics.prometheus import get_prometheus_registry

        instance_id = getattr(vllm_config, "instance_id", "")
        if not instance_id or instance_id in _serving:
            return
        _serving.add(instance_id)
        if get_prometheus_registry() is not REGISTRY:
            logger.warning("vllm_ascend_rl metrics are not on /metrics with --api-server-count > 1")
            return
        metrics.remove_abandoned_dirs()
        directory = metrics.engine_metrics_dir(instance_id)
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, metrics.OWNER), "w") as f:
            f.write(str(os.getpid()))
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
        REGISTRY.register(metrics.Collector(lambda: metrics.engine_rows(directory)))

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_engine_initialized(self) -> None:
        pass
