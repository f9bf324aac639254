"""Shared by tests, examples and benchmarks (never imported by the plugin itself):
tiny random-weight models, a vLLM server launcher and token-counting request helpers."""

import os

from vllm_ascend_rl.testing.server import ServerStartError, VLLMServer, free_port, serving
from vllm_ascend_rl.testing.streams import (
    StreamingCompletion,
    complete,
    completion_body,
    greedy_token_ids,
)
from vllm_ascend_rl.testing.tiny_model import (
    TinyModelSpec,
    build_model_pair,
    build_tiny_model,
    load_hf_model,
)

PLUGIN_SCHEDULER = "vllm_ascend_rl.core.recompute_scheduler.AsyncRecomputeScheduler"


def engine_args() -> list[str]:
    """Server flags shared by tests and the CPU demo.

    ``--enforce-eager`` skips the ~30 s inductor compile of every new checkpoint on CPU; set
    ``VLLM_ASCEND_RL_COMPILE=1`` to run with vLLM's default compile mode instead.
    """
    return [] if os.environ.get("VLLM_ASCEND_RL_COMPILE") == "1" else ["--enforce-eager"]


__all__ = [
    "PLUGIN_SCHEDULER",
    "ServerStartError",
    "StreamingCompletion",
    "TinyModelSpec",
    "VLLMServer",
    "build_model_pair",
    "build_tiny_model",
    "complete",
    "completion_body",
    "engine_args",
    "free_port",
    "greedy_token_ids",
    "load_hf_model",
    "serving",
]
