"""STAND-IN for the ``vllm_config`` a weight-transfer engine reads, for unit tests that build an
engine without vLLM: one worker, no model, no scheduler bound to its step gate."""

from __future__ import annotations

import types
from typing import Any


def engine_config(**fields: Any) -> types.SimpleNamespace:
    parallel = types.SimpleNamespace(
        rank=0, world_size=1, data_parallel_index=0, data_parallel_rank=0, data_parallel_size=1
    )
    return types.SimpleNamespace(
        parallel_config=parallel, model_config=None, instance_id="unit", **fields
    )
