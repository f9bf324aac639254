"""Drive a vLLM scheduler in-process, built from vLLM's own config objects, with no model.

Used by the scheduler unit tests and the scheduler-overhead benchmark: a scheduler class is
constructed exactly as the engine core constructs it, requests are real ``vllm.v1.request``
objects, and :func:`fake_model_output` plays the model runner (one sampled token per request
that finished its prefill).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

from tests.support.tiny_model import TinyModelSpec, build_tiny_model
from tests.support.vllm_features import runner_output_takes_index
from vllm_ascend_rl.readiness import ModelReadiness, gate_address


class SchedulerHarness:
    """One scheduler plus the request factory that matches its block hashing."""

    def __init__(
        self,
        scheduler_cls: type[Scheduler],
        *,
        num_blocks: int = 64,
        block_size: int = 32,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 2048,
        max_model_len: int = 2048,
        policy: str = "fcfs",
        enable_prefix_caching: bool = True,
        model_path: Path | None = None,
        additional_config: dict | None = None,
        data_parallel_index: int = 0,
        instance_id: str | None = None,
    ) -> None:
        """``data_parallel_index``/``instance_id``: the config one dense data-parallel engine
        core of a server runs with (vLLM makes it DP=1, rank 0, keeping the index)."""
        path = model_path or build_tiny_model(TinyModelSpec())
        model_config = ModelConfig(model=str(path), dtype="bfloat16", max_model_len=max_model_len)
        cache_config = CacheConfig(
            block_size=block_size, enable_prefix_caching=enable_prefix_caching
        )
        sched_config = SchedulerConfig(
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            is_encoder_decoder=False,
            policy=policy,
        )
        self.vllm_config = VllmConfig(
            model_config=model_config,
            cache_config=cache_config,
            scheduler_config=sched_config,
            additional_config=additional_config or {},
        )
        self.vllm_config.instance_id = instance_id or self.vllm_config.instance_id
        self.vllm_config.parallel_config.data_parallel_index = data_parallel_index
        cache_config.num_gpu_blocks = num_blocks
        spec = FullAttentionSpec(
            block_size=block_size, num_kv_heads=2, head_size=64, dtype=torch.bfloat16
        )
        kv_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
        )
        self.scheduler: Scheduler = scheduler_cls(
            vllm_config=self.vllm_config,
            kv_cache_config=kv_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=block_size,
            log_stats=False,
        )
        hash_fn = get_hash_fn_by_name(cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self._block_hasher = get_request_block_hasher(block_size, hash_fn)
        self._ids = itertools.count()

    def make_request(
        self,
        prompt_len: int = 40,
        max_tokens: int = 16,
        *,
        priority: int = 0,
        request_id: str | None = None,
        first_token: int = 1,
    ) -> Request:
        rid = request_id or f"req-{next(self._ids)}"
        prompt = [(first_token + i) % 500 + 1 for i in range(prompt_len)]
        return Request(
            rid,
            prompt,
            SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            None,
            priority=priority,
            block_hasher=self._block_hasher,
        )

    def add(self, *args, **kwargs) -> Request:
        req = self.make_request(*args, **kwargs)
        self.scheduler.add_request(req)
        return req

    def step(self, token: int = 7) -> tuple[SchedulerOutput, dict]:
        """One synchronous engine step: schedule, fake the model, feed the output back."""
        out = self.scheduler.schedule()
        return out, self.scheduler.update_from_output(
            out, fake_model_output(self.scheduler, out, token)
        )


def fake_model_output(
    scheduler: Scheduler, out: SchedulerOutput, token: int = 7
) -> ModelRunnerOutput:
    """What the model runner returns for ``out``: a token for each request past its prefill."""
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in req_ids:
        req = scheduler.requests.get(rid)
        done_prefill = req is not None and not req.is_prefill_chunk
        sampled.append([token] if done_prefill else [])
    index = {}
    if runner_output_takes_index():
        index["req_id_to_index"] = {r: i for i, r in enumerate(req_ids)}
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, **index)


def announced(harness: SchedulerHarness, worker: int = 0) -> ModelReadiness:
    """A worker's readiness, announced to the harness scheduler's step gate over the real
    socket, as a weight-transfer engine announces it."""
    readiness = ModelReadiness()
    readiness.announce_to(gate_address(harness.vllm_config), worker)
    return readiness
