"""What the examples stand on, not the point of them (and what the test kit, ``tests/support``,
re-exports): tiny random-weight checkpoints, a vLLM server launcher, token-counting request
helpers, the device profile, and the engine flags shared by examples and tests.

Its modules import each other relatively, so the package works both as ``plumbing`` (an example
run as a script, with ``examples/`` first on ``sys.path``) and as ``examples.plumbing``."""

import os

from .profile import current_profile
from .server import ServerStartError, VLLMServer, free_port, serving
from .streams import StreamingCompletion, complete, completion_body, greedy_token_ids
from .tiny_model import TinyModelSpec, build_model_pair, build_tiny_model, load_hf_model

PLUGIN_SCHEDULER = "vllm_ascend_rl.core.recompute_scheduler.AsyncRecomputeScheduler"


def engine_args(graphs: bool = False) -> list[str]:
    """Server flags shared by tests and the CPU demo.

    ``--enforce-eager`` skips the ~30 s inductor compile of every new checkpoint on CPU;
    ``graphs`` (or ``VLLM_ASCEND_RL_COMPILE=1``) runs vLLM's default compile mode instead (on
    Ascend: vllm-ascend's default ACL graph mode).
    """
    graphs = graphs or os.environ.get("VLLM_ASCEND_RL_COMPILE") == "1"
    return [] if graphs else ["--enforce-eager"]


def rl_engine_args(
    backend: str | None = "ascend_rl_hccl", *, sleepable: bool = False, graphs: bool = False
) -> list[str]:
    """``engine_args(graphs)`` for an RL engine: the plugin scheduler, a weight-transfer
    backend (``None``: none) and, with ``sleepable``, the device's sleepable worker."""
    args = [*engine_args(graphs), "--scheduler-cls", PLUGIN_SCHEDULER]
    if sleepable:
        args += ["--worker-cls", current_profile().sleepable_worker]
    if backend:
        args += ["--weight-transfer-config", f'{{"backend": "{backend}"}}']
    return args


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
    "rl_engine_args",
    "serving",
]
