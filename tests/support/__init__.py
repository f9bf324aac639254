"""The test kit, shared by tests, benchmarks and the examples' demo plumbing (not installed:
the package keeps only what users import): tiny random-weight models, a vLLM server launcher,
token-counting request helpers, the stand-in trainer process, the device profile."""

import os

from tests.support.server import ServerStartError, VLLMServer, free_port, serving
from tests.support.streams import (
    StreamingCompletion,
    complete,
    completion_body,
    greedy_token_ids,
)
from tests.support.tiny_model import (
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
