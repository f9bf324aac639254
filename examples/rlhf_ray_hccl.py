"""Async RL on Ray with the HCCL weight-transfer engine: one trainer actor, two vLLM engine
actors, one sync reaching both engines while their requests are paused mid-stream.

The flow of vLLM's and vllm-ascend's ``examples/rl/rlhf_async_new_apis.py``, on this plugin's
HCCL engine and vLLM's public trainer API:

1. Set-up: a placement group with one bundle per actor; a trainer actor holding the new
   weights (v2); two engine actors, each a vLLM ``AsyncLLM`` in process on the old weights
   (v1), with the plugin scheduler and ``weight_transfer_config=ascend_rl_hccl``. The trainer
   connects to each engine with ``WeightTransferTrainerFactory.trainer_init`` over vLLM's
   ``RayVLLMWeightSyncClient``: one HCCL group per engine (world size 1 + its workers).
2. The loop: requests stream on both engines; once every request has tokens, both engines
   pause (``keep``: requests stay, their KV cache is dropped); the trainer syncs each engine;
   both resume, and every request finishes on the new weights.
3. Validation: one engine loads v2 from disk with vLLM's own loader (``reload_weights``), and
   from prompt + tokens generated before the pause it must reproduce, greedily, every token
   generated after, on both engines.

On CPU (the default) it builds tiny random-weight checkpoints and runs a local Ray cluster; CI
runs it that way. On Ascend::

    python examples/rlhf_ray_hccl.py --device npu --model-v1 /ckpt/base --model-v2 /ckpt/trained

(``pip install 'vllm_ascend_rl[ray]'``; one NPU per actor.)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import uuid

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

PLUGIN_SCHEDULER = "vllm_ascend_rl.core.recompute_scheduler.AsyncRecomputeScheduler"
PROMPTS = [
    "The weather today is",
    "Once upon a time there was",
    "In reinforcement learning, the policy",
    "def fibonacci(n):",
]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=["cpu", "npu"], default="cpu")
    ap.add_argument("--model-v1", help="checkpoint the engines start on (default: tiny, CPU)")
    ap.add_argument("--model-v2", help="checkpoint the trainer holds (default: tiny, CPU)")
    ap.add_argument("--max-tokens", type=int, default=120)
    ap.add_argument("--min-tokens", type=int, default=8, help="per request, before the pause")
    ap.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="of each engine's NPU (vLLM's default; lower to share chips with other servers)",
    )
    return ap.parse_args()


def engine_kwargs(model: str, device: str, memory: float) -> dict:
    """vLLM engine arguments (``AsyncEngineArgs``) for an RL engine."""
    from vllm.config import WeightTransferConfig

    kwargs: dict = dict(
        model=model,
        dtype="bfloat16",
        max_model_len=2048,
        enforce_eager=True,
        scheduler_cls=PLUGIN_SCHEDULER,
        weight_transfer_config=WeightTransferConfig(backend="ascend_rl_hccl"),
    )
    if device == "cpu":
        kwargs["gpu_memory_utilization"] = 0.1  # the KV cache is VLLM_CPU_KVCACHE_SPACE
    else:
        kwargs["gpu_memory_utilization"] = memory
        kwargs["additional_config"] = {"weight_nz_mode": 0}  # NZ off (README)
    return kwargs


@ray.remote
class Engine:
    """A vLLM ``AsyncLLM`` in this actor's process. ``RayVLLMWeightSyncClient`` calls its
    weight-transfer methods by name; ``generate`` records, per request, how many tokens it
    had when the engine paused."""

    def __init__(self, kwargs: dict) -> None:
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))
        self.tokens: dict[str, int] = {}  # request id -> tokens so far
        self.at_pause: dict[str, int] = {}

    async def generate(self, prompt_ids: list[int], max_tokens: int) -> dict:
        from vllm import SamplingParams

        rid = uuid.uuid4().hex
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        async for out in self.llm.generate({"prompt_token_ids": prompt_ids}, params, rid):
            self.tokens[rid] = len(out.outputs[0].token_ids)
        return {
            "prompt": prompt_ids,
            "tokens": list(out.outputs[0].token_ids),
            "finish_reason": out.outputs[0].finish_reason,
            "at_pause": self.at_pause.get(rid),
        }

    async def wait_for_tokens(self, count: int, min_tokens: int, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while sum(n >= min_tokens for n in self.tokens.values()) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"requests did not reach {min_tokens} tokens: {self.tokens}")
            await asyncio.sleep(0.01)

    async def pause(self) -> float:
        """``pause_generation(mode="keep")``; records each request's tokens once the outputs
        already produced have arrived. Returns the pause's milliseconds."""
        t0 = time.perf_counter()
        await self.llm.pause_generation(mode="keep", clear_cache=True)
        ms = (time.perf_counter() - t0) * 1e3
        last = None
        while last != self.tokens:  # nothing is generated while paused: wait for quiet
            last = dict(self.tokens)
            await asyncio.sleep(0.3)
        self.at_pause = dict(self.tokens)
        return ms

    async def resume(self) -> None:
        await self.llm.resume_generation()

    # -- the weight-sync surface RayVLLMWeightSyncClient drives ---------------------------
    async def init_weight_transfer_engine(self, request) -> None:
        await self.llm.init_weight_transfer_engine(request)

    async def start_weight_update(self) -> None:
        await self.llm.start_weight_update()

    async def update_weights(self, request) -> None:
        await self.llm.update_weights(request)

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        await self.llm.finish_weight_update(weight_version)

    async def reload_weights(self, path: str) -> None:
        """vLLM's own load of the checkpoint at ``path`` (the validation's reference)."""
        await self.llm.collective_rpc("reload_weights", kwargs={"weights_path": path})

    async def update_weight_version(self, version: str) -> None:
        await self.llm.update_weight_version(version)

    async def shutdown_weight_transfer_engine(self) -> None:
        await self.llm.shutdown_weight_transfer_engine()

    def shutdown(self) -> None:
        # vLLM's default grace is 5 s, then SIGKILL; its engine core may itself wait up to
        # VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS + 4 s for its workers. Killed in between, the
        # engine core leaves its shared-memory queues (hundreds of MiB) in /dev/shm.
        self.llm.shutdown(timeout=60)


@ray.remote
class Trainer:
    """The policy (v2 here: a finished training step) and one weight-sync engine per vLLM
    engine, on vLLM's public trainer API."""

    def __init__(self, model: str, device: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        import vllm_ascend_rl

        vllm_ascend_rl.register()  # a trainer is not a vLLM process: register by hand
        if device == "npu":
            import torch_npu  # noqa: F401  (registers the "npu" device with torch)
        self.model = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.bfloat16)
        self.model.to(device)
        self.syncs: list = []

    def connect(self, engines: list, workers_per_engine: int) -> None:
        from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.clients import RayVLLMWeightSyncClient
        from vllm.utils.network_utils import get_ip, get_open_port

        from vllm_ascend_rl.weight_transfer.hccl import HCCLTrainerInitInfo

        for engine in engines:  # one group per engine: see docs/deployment.md
            info = HCCLTrainerInitInfo(
                master_address=get_ip(),
                master_port=get_open_port(),
                world_size=1 + workers_per_engine,
                rank=0,  # the sending trainer rank (another rank would only follow)
                timeout_s=120,
            )
            self.syncs.append(
                WeightTransferTrainerFactory.trainer_init(
                    info, client=RayVLLMWeightSyncClient(engine), source=ModuleSource(self.model)
                )
            )

    def sync(self, weight_version: str) -> list[float]:
        """Send the weights to every engine, one after the other; seconds per engine."""
        return [s.send_weights(weight_version=weight_version).seconds for s in self.syncs]


def tiny_checkpoints() -> tuple[str, str]:
    """Demo plumbing, not the point: two tiny random-weight checkpoints (v1, v2) on CPU."""
    if __package__:  # imported from the repository root: examples.rlhf_ray_hccl
        from .plumbing import build_model_pair
    else:  # run as a script: python examples/rlhf_ray_hccl.py
        from plumbing import build_model_pair

    v1, v2 = build_model_pair()
    return str(v1), str(v2)


def main() -> int:
    args = parse_args()
    v1, v2 = (args.model_v1, args.model_v2) if args.model_v1 else tiny_checkpoints()
    from transformers import AutoTokenizer

    prompts = [AutoTokenizer.from_pretrained(v1).encode(p) for p in PROMPTS]
    env = {"VLLM_ASCEND_RL_DEVICE": args.device, "VLLM_CPU_KVCACHE_SPACE": "1"}
    if args.device == "cpu":
        # Each engine's worker in its engine core process, as on NPU (vLLM's CPU platform
        # would give it a process of its own), with one OpenMP thread: one import fewer.
        env |= {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}
        ray.init(num_cpus=3, object_store_memory=200 << 20, runtime_env={"env_vars": env})
        bundle = {"CPU": 1}
    else:
        ray.init(runtime_env={"env_vars": env})
        bundle = {"CPU": 1, "NPU": 1}
    try:
        return run(args, v1, v2, prompts, bundle)
    finally:
        ray.shutdown()


def run(args: argparse.Namespace, v1: str, v2: str, prompts: list, bundle: dict) -> int:
    # -- 1. set-up -----------------------------------------------------------------------
    pg = placement_group([bundle] * 3, strategy="PACK")
    ray.get(pg.ready())

    def in_bundle(i: int) -> dict:
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
        # An actor gets the bundle's NPU (Ray sets ASCEND_RT_VISIBLE_DEVICES) only if it asks.
        npu = {"resources": {"NPU": 1}} if "NPU" in bundle else {}
        return {"num_cpus": 1, "scheduling_strategy": strategy, **npu}

    device = "cpu" if args.device == "cpu" else "npu"
    trainer = Trainer.options(**in_bundle(0)).remote(v2, device)
    kwargs = engine_kwargs(v1, device, args.gpu_memory_utilization)
    engines = [Engine.options(**in_bundle(i)).remote(kwargs) for i in (1, 2)]
    ray.get(trainer.connect.remote(engines, workers_per_engine=1))
    print("trainer connected to both engines (one HCCL group each, world size 2)")

    # -- 2. generate -> pause(keep) -> sync -> resume ---------------------------------------
    futures = [e.generate.remote(p, args.max_tokens) for e in engines for p in prompts]
    ray.get([e.wait_for_tokens.remote(len(prompts), args.min_tokens) for e in engines])
    pause_ms = ray.get([e.pause.remote() for e in engines])
    t0 = time.perf_counter()
    sync_s = ray.get(trainer.sync.remote("v2"))
    sync_ms = (time.perf_counter() - t0) * 1e3
    ray.get([e.resume.remote() for e in engines])
    results = ray.get(futures)
    print(
        f"pause {max(pause_ms):.0f} ms, sync {sync_ms:.0f} ms for 2 engines "
        f"({', '.join(f'{s * 1e3:.0f} ms' for s in sync_s)}), {len(results)} requests resumed"
    )
    ray.kill(trainer)

    # -- 3. validate against vLLM's own load of v2 --------------------------------------------
    reference = engines[0]
    ray.get(reference.reload_weights.remote(v2))
    checks = []
    for r in results:
        split = r["at_pause"]
        assert r["finish_reason"] == "length" and len(r["tokens"]) == args.max_tokens, r
        assert split is not None and 0 < split < args.max_tokens, f"paused at {split} tokens"
        after = r["tokens"][split:]
        checks.append(reference.generate.remote(r["prompt"] + r["tokens"][:split], len(after)))
    continued = ray.get(checks)
    matches = [
        c["tokens"] == r["tokens"][r["at_pause"] :]
        for c, r in zip(continued, results, strict=False)
    ]
    for e in engines:
        ray.get(e.shutdown.remote())
        ray.kill(e)
    remove_placement_group(pg)
    print(f"{sum(matches)}/{len(matches)} continuations equal vLLM's own load of v2")
    ok = all(matches)
    print("validated: every request continued exactly on the new weights" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    raise SystemExit(main())
