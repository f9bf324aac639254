"""Loggers whose lines reach the vLLM server log: vLLM configures a handler only for the
``vllm`` logger tree, so ``vllm_ascend_rl.x`` logs as ``vllm.vllm_ascend_rl.x``."""

from __future__ import annotations

import logging


def get_logger(name: str) -> logging.Logger:
    from vllm.logger import init_logger

    return init_logger(name if name.startswith("vllm.") else f"vllm.{name}")
