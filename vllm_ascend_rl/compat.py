"""How the supported vLLM releases (``stacks.SUPPORTED``: 0.30.0 and 0.32.0) differ, by
feature, never by version: the table is docs/ascend-conformance.md §2 (probes:
``tests/support/vllm_features.py``; internals we rely on: docs/upstream-internals.md). Here:
``/weight_checker``'s worker methods, in 0.32's GPU ``Worker`` but not in 0.30's nor in
vllm-ascend's ``NPUWorker`` (:func:`weight_checker_methods`), and the MTP completeness check a
partial load turns off, gone in 0.34 (:func:`mtp_check_off`)."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

WEIGHT_CHECKER_METHODS = ("compute_weight_checksums", "_weight_checksum_prefix", "reset_weights")


def weight_checker_methods(base: type) -> dict[str, Any]:
    """vLLM's ``/weight_checker`` worker methods that ``base`` lacks (none before 0.32), lent
    from the GPU ``Worker``: they only read the parallel ranks and ``model_runner.get_model()``."""
    from vllm.v1.worker.gpu_worker import Worker

    return {
        name: vars(Worker)[name]
        for name in WEIGHT_CHECKER_METHODS
        if name in vars(Worker) and not hasattr(base, name)
    }


def mtp_check_off() -> AbstractContextManager:
    """vLLM's MTP completeness check off for a partial load (it raises on a model whose MTP
    layers a bucket leaves out), where vLLM has one (before 0.34)."""
    try:
        from vllm.model_executor.model_loader.mtp_validation import (
            disable_mtp_completeness_check,
        )
    except ImportError:
        return nullcontext()
    return disable_mtp_completeness_check()
