"""Every upstream internal listed in ``docs/upstream-internals.md``, checked on this vLLM leg.

``test_<key>`` guards the table's entry ``key``; its assertion messages say what changed upstream
and which file of ours depends on it. Real vLLM and torch objects wherever CPU allows; a
STAND-IN is labelled where a test needs one. The table's NPU entries (torch_npu, vllm-ascend)
have no test here: they are checked on NPU only (``make test-npu``).
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import inspect
import re
import textwrap
import types
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

import pytest
import torch

from tests.conftest import CANARY
from vllm_ascend_rl import compat

TABLE = (Path(__file__).parents[2] / "docs" / "upstream-internals.md").read_text()


def params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def required(fn) -> list[str]:
    """The parameters a caller must pass (no default, not ``*args``/``**kwargs``)."""
    return [
        p.name
        for p in inspect.signature(fn).parameters.values()
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]


def source(obj) -> str:
    return textwrap.dedent(inspect.getsource(obj))


def assigns(cls_or_fn, attr: str) -> bool:
    """Whether the source assigns ``self.<attr>`` (annotated or not)."""
    return re.search(rf"self\.{attr}\b\s*(:[^=\n]*)?=(?!=)", source(cls_or_fn)) is not None


# -- the table itself --------------------------------------------------------------------------
def entries(text: str) -> list[str]:
    return re.findall(r"^- `(\w+)`", text, re.M)


def test_the_table_counts_its_entries_and_each_has_a_test():
    product, standin = TABLE.split("Upstream internals of the CPU stand-in")
    keys, npu = entries(TABLE), set(re.findall(r"^- `(\w+)` \(NPU\)", TABLE, re.M))
    assert len(keys) == len(set(keys)), "docs/upstream-internals.md lists an internal twice"
    declared = re.search(r"Upstream internals \((\d+), (\d+) NPU only\)", product)
    assert declared, (
        "docs/upstream-internals.md must state its count: 'Upstream internals (N, M NPU only)'"
    )
    assert (int(declared[1]), int(declared[2])) == (len(entries(product)), len(npu)), (
        f"the table says {declared[0]!r} but lists {len(entries(product))} ({len(npu)} NPU only)"
    )
    assert standin.startswith(f" ({len(entries(standin))};"), "the stand-in's count is off"
    this = "test_the_table_counts_its_entries_and_each_has_a_test"
    tests = [n for n in globals() if n.startswith("test_") and n != this]
    untested = [k for k in keys if k not in npu and f"test_{k}" not in tests]
    assert not untested, f"table entries without a test_<key> here: {untested}"
    faked = [k for k in npu if f"test_{k}" in tests]
    assert not faked, f"NPU-only entries cannot be tested on CPU; remove test_<key> for {faked}"
    stray = [
        t for t in tests if not any(t == f"test_{k}" or t.startswith(f"test_{k}_") for k in keys)
    ]
    assert not stray, (
        f"tests that guard no table entry (add the entry to docs/upstream-internals.md): {stray}"
    )


# -- vLLM: scheduler and engine core -----------------------------------------------------------
def test_scheduler_classes():
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.interface import PauseState
    from vllm.v1.core.sched.scheduler import Scheduler

    where = "core/recompute_scheduler.py subclasses it"
    assert params(Scheduler)[:1] == ["vllm_config"], (
        f"vLLM's Scheduler no longer takes vllm_config first ({params(Scheduler)}): {where} "
        "and reads it to refuse bounce with a connector"
    )
    for hook in ("schedule", "update_from_output", "has_requests", "set_pause_state"):
        assert callable(getattr(Scheduler, hook, None)), f"vLLM's Scheduler lost {hook}(): {where}"
    assert "reset_running_requests" in params(Scheduler.reset_prefix_cache), (
        f"vLLM's Scheduler.reset_prefix_cache changed its parameters: {where}"
    )
    assert isinstance(inspect.getattr_static(Scheduler, "pause_state"), property), (
        f"vLLM's Scheduler.pause_state is no longer a property: {where}"
    )
    assert {"UNPAUSED", "PAUSED_NEW", "PAUSED_ALL"} <= set(PauseState.__members__), (
        f"vLLM's PauseState members changed ({list(PauseState.__members__)}): {where}"
    )
    assert issubclass(AsyncScheduler, Scheduler), (
        "vLLM's AsyncScheduler no longer extends Scheduler: AsyncRecomputeScheduler's MRO in "
        "core/recompute_scheduler.py relies on it"
    )


def test_pause_state_attribute():
    from vllm.v1.core.sched.scheduler import Scheduler

    assert "self._pause_state == PauseState.PAUSED_ALL" in source(Scheduler.schedule), (
        "vLLM's Scheduler.schedule() no longer reads self._pause_state for PAUSED_ALL: the "
        "step gate (recompute_scheduler.py:schedule) sets it while a worker is not ready"
    )
    assert assigns(Scheduler.__init__, "_pause_state"), "vLLM's Scheduler lost _pause_state"


def test_dp_engine_loop():
    from vllm.v1.core.sched.interface import SchedulerInterface
    from vllm.v1.engine.core import DPEngineCoreProc

    where = "core/recompute_scheduler.py (get_num_unfinished_requests) ends the DP wave"
    loop = source(DPEngineCoreProc)  # run_busy_loop, under a fault-tolerance wrapper
    assert "self.scheduler.has_unfinished_requests()" in loop and "execute_dummy_batch" in loop, (
        f"vLLM's DP engine loop no longer counts work with has_unfinished_requests: {where}"
    )
    counts = types.SimpleNamespace(get_num_unfinished_requests=lambda: 0)
    assert SchedulerInterface.has_unfinished_requests(counts) is False, (
        f"vLLM's has_unfinished_requests no longer asks get_num_unfinished_requests: {where}"
    )


def test_preempt_request():
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    where = "core/recompute_scheduler.py overrides it to bounce KV-starved requests"
    hook = getattr(Scheduler, "_preempt_request", None)
    assert hook is not None, f"vLLM's Scheduler lost _preempt_request: {where}"
    assert params(hook) == ["self", "request", "timestamp", "drop_stale_output"], (
        f"vLLM's Scheduler._preempt_request{inspect.signature(hook)} changed: {where}"
    )
    assert "self._preempt_request(" in source(Scheduler.schedule), (
        "vLLM's Scheduler.schedule() no longer preempts through self._preempt_request: the "
        "bounce in core/recompute_scheduler.py would never run"
    )
    between = AsyncScheduler.__mro__[: AsyncScheduler.__mro__.index(Scheduler)]
    for cls in between:
        if "_preempt_request" in vars(cls):
            assert "super()._preempt_request(" in source(cls._preempt_request), (
                f"vLLM's {cls.__name__} overrides _preempt_request without calling super(): "
                f"AsyncRecomputeScheduler's bounce ({where}) would be bypassed"
            )


def test_free_request():
    from vllm.v1.core.sched.scheduler import Scheduler

    where = "core/recompute_scheduler.py (_bounce) finishes a victim through it"
    free = getattr(Scheduler, "_free_request", None)
    assert free is not None, f"vLLM's Scheduler lost _free_request: {where}"
    assert required(free) == ["self", "request"], (
        f"vLLM's Scheduler._free_request{inspect.signature(free)} changed: {where}"
    )
    assert "finished_req_ids" in source(free), (
        "vLLM's Scheduler._free_request no longer records finished_req_ids: a bounced request "
        f"would stay on the worker ({where})"
    )


def test_request_finish():
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import FinishReason
    from vllm.v1.request import Request, RequestStatus

    where = "core/recompute_scheduler.py (_bounce, update_from_output) finishes a bounce with it"
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=4), None)
    for attr in ("stop_reason", "trace_headers", "client_index", "num_output_tokens"):
        assert hasattr(request, attr), f"vLLM's Request lost {attr}: {where}"
    assert hasattr(RequestStatus, "FINISHED_ABORTED"), (
        f"vLLM's RequestStatus lost FINISHED_ABORTED: {where}"
    )
    request.status = RequestStatus.FINISHED_ABORTED
    assert request.is_finished() and request.get_finished_reason() == FinishReason.ABORT, (
        f"a Request set to FINISHED_ABORTED no longer finishes with FinishReason.ABORT: {where}, "
        'and the router (router/) recognises a bounce by finish_reason="abort"'
    )
    events = request.take_events()
    assert events is None or isinstance(events, list), (
        f"vLLM's Request.take_events() changed its result ({events!r}): {where}"
    )


def test_engine_core_output():
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason

    where = "core/recompute_scheduler.py (update_from_output) builds a bounce's output with it"
    fields = set(EngineCoreOutput.__struct_fields__)
    wanted = {"request_id", "new_token_ids", "finish_reason", "stop_reason", "events"}
    wanted.add("trace_headers")
    assert wanted <= fields, f"vLLM's EngineCoreOutput lost {sorted(wanted - fields)}: {where}"
    out = EngineCoreOutput(
        request_id="r",
        new_token_ids=[],
        finish_reason=FinishReason.ABORT,
        stop_reason="recomputed",
        events=None,
        trace_headers=None,
    )
    assert EngineCoreOutputs(outputs=[out]).outputs == [out], (
        f"vLLM's EngineCoreOutputs(outputs=...) changed: {where}"
    )


def test_engine_core_calls():
    from vllm.v1.engine.core import EngineCore

    where = "core/engine_calls.py finds it on the stack to tell sleep, wake and resume apart"
    for name, local in (("sleep", "level"), ("wake_up", "tags"), ("resume_scheduler", None)):
        method = getattr(EngineCore, name, None)
        assert method is not None, f"vLLM's EngineCore lost {name}(): {where}"
        assert local is None or local in params(method), (
            f"vLLM's EngineCore.{name}{inspect.signature(method)} has no {local!r}: {where}"
        )
    assert assigns(EngineCore.__init__, "scheduler"), (
        f"vLLM's EngineCore no longer keeps its scheduler in self.scheduler: {where}"
    )
    # Which calls reach the scheduler, and how: tests/unit/test_engine_calls.py.


# -- vLLM: weight transfer and layerwise reload ------------------------------------------------
def test_worker_update_flag():
    from vllm.config import VllmConfig
    from vllm.v1.worker.gpu_worker import Worker

    from vllm_ascend_rl.weight_transfer.connection import NotOwner
    from vllm_ascend_rl.worker import SleepableMixin

    where = "worker/__init__.py (SleepableMixin.update_weights) keeps the owner's update"
    worker = object.__new__(type("Plugins", (SleepableMixin, Worker), {}))  # STAND-IN state
    worker.vllm_config = VllmConfig()  # vLLM's own update_weights runs under the mixin's
    # What Worker.__init__ sets that vLLM 0.34's update_weights reads when it ends an update.
    worker._weight_update_kv_cache_loan = contextlib.ExitStack()
    worker._weight_update_is_draft = False
    for error, kept in ((NotOwner("another trainer's"), True), (ValueError("refused"), False)):
        worker._weight_update_active = True

        def refuse(info, error=error):
            raise error

        worker.weight_transfer_engine = types.SimpleNamespace(
            update_weights=refuse, reset_weight_update_target=lambda: None
        )
        with pytest.raises(type(error)):
            worker.update_weights({})
        assert worker._weight_update_active is kept, (
            "vLLM's Worker.update_weights no longer records an open update in "
            f"_weight_update_active, ended on any error: {where}"
        )


def test_info_bases():
    from vllm.distributed.weight_transfer import base

    from vllm_ascend_rl.weight_transfer.hccl import HCCLTrainerInitInfo

    where = "weight_transfer/{hccl,npu_ipc,wire}.py subclass it"
    for name in ("WeightTransferInitInfo", "WeightTransferUpdateInfo", "TrainerInitInfo"):
        assert isinstance(getattr(base, name, None), type), (
            f"vllm.distributed.weight_transfer.base lost {name}: {where}"
        )
    fields = {f.name for f in dataclasses.fields(base.TrainerInitInfo)}
    assert "rank" in fields and "backend" in base.TrainerInitInfo.__annotations__, (
        f"vLLM's TrainerInitInfo changed its fields ({fields}): {where}; the trainer factory "
        "dispatches on its class-level backend"
    )
    info = HCCLTrainerInitInfo(master_address="h", master_port=1, world_size=2, rank=1)
    assert info.is_sender is False, f"vLLM's TrainerInitInfo.is_sender changed: {where}"


@pytest.fixture
def reloading():
    """Two real linear layers under vLLM's layerwise reload, opened by our LayerwiseReload."""
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

    from vllm_ascend_rl.weight_transfer.reload import LayerwiseReload

    class TwoLayers(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)

        def load_weights(self, weights) -> None:  # as vLLM models do: each param's loader
            named = dict(self.named_parameters())
            for name, tensor in weights:
                named[name].weight_loader(named[name], tensor)

    torch.manual_seed(0)
    model = TwoLayers()
    old = {n: (p.detach().clone(), p.data_ptr()) for n, p in model.named_parameters()}
    record_metadata_for_reloading(model)
    reload = LayerwiseReload()
    reload.begin(model, None)
    yield model, reload, old
    reload.abort(None)


def info(layer):
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    return get_layerwise_info(layer)


def test_layerwise_info(reloading):
    model, _, _ = reloading
    where = "weight_transfer/reload.py reads and edits it"
    state = info(model.a)
    assert state is info(model.a), (
        f"vLLM's get_layerwise_info no longer returns the layer's live reload state: {where}"
    )
    names = {f.name for f in dataclasses.fields(state)}
    lost = {"load_numel", "load_numel_total", "loaded_weights", "kernel_tensors"} - names
    assert not lost, f"vLLM's LayerReloadingInfo lost {sorted(lost)}: {where}"


def test_can_load(reloading):
    model, _, _ = reloading
    assert info(model.a).can_load(), (
        "vLLM's LayerReloadingInfo.can_load() is False for a layer waiting for its weights: "
        "weight_transfer/reload.py finds the layers an update may touch by it"
    )
    model.load_weights([("a.weight", torch.ones(3, 4)), ("a.bias", torch.ones(3))])
    assert not info(model.a).can_load(), (
        "vLLM's LayerReloadingInfo.can_load() stays True once a layer is processed: "
        "weight_transfer/reload.py (abort) restores complete layers from the host copy by it"
    )


def test_load_numel(reloading):
    model, reload, old = reloading
    model.load_weights([("a.weight", torch.ones(3, 4)), ("a.bias", torch.ones(3))])
    model.load_weights([("b.weight", torch.ones(2, 3))])  # b is left partial
    assert info(model.b).load_numel == 6, (
        "vLLM's LayerReloadingInfo.load_numel no longer counts the elements a layer received: "
        "weight_transfer/reload.py (abort) tells a partial layer by it"
    )
    # A loader may write part of a layer at once (vLLM CPU's fused qkv_proj.bias was seen to).
    info(model.b).kernel_tensors[0]["bias"].data.fill_(7)
    # a (complete) and b (partial) restored: their float32 bytes
    assert reload.abort(None) == (2, 0, (12 + 3 + 6 + 2) * 4)
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, old[n][0])]
    assert not changed, (
        f"an aborted update left {changed} changed: vLLM's finalize no longer puts a layer's "
        "kernel tensors back once weight_transfer/reload.py zeroes load_numel and clears "
        "loaded_weights"
    )


def test_load_numel_total(reloading):
    model, reload, _ = reloading
    totals = {name: info(m).load_numel_total for name, m in model.named_modules()}
    assert totals == {"": 0, "a": 15, "b": 8}, (
        f"vLLM's LayerReloadingInfo.load_numel_total changed meaning ({totals}): "
        "weight_transfer/reload.py keeps the layers that take weights by it"
    )
    assert reload._pending == [model.a, model.b]


def test_loaded_weights(reloading):
    model, reload, _ = reloading
    ring = torch.zeros(64)  # the engine loads straight from a staging buffer (NPU IPC)
    model.load_weights([("b.weight", ring[:6].view(2, 3))])
    ((name, bound),) = info(model.b).loaded_weights
    assert name == "weight" and isinstance(bound, inspect.BoundArguments), (
        f"vLLM's LayerReloadingInfo.loaded_weights holds {name!r}, {type(bound).__name__}, "
        "not (name, BoundArguments): weight_transfer/reload.py (evacuate, abort) edits them"
    )
    assert reload.evacuate(ring) == 1, (
        "weight_transfer/reload.py (evacuate) found no buffered tensor aliasing the staging "
        "buffer in vLLM's loaded_weights: NPU-IPC zero_copy would hand back a buffer in use"
    )
    ptr = ring.untyped_storage().data_ptr()
    assert not any(
        isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() == ptr
        for v in bound.arguments.values()
    ), "rewriting BoundArguments.arguments no longer changes what vLLM will load"


def test_kernel_tensors(reloading):
    model, _, old = reloading
    kernel = info(model.a).kernel_tensors
    assert isinstance(kernel, tuple) and len(kernel) == 2, (
        f"vLLM's LayerReloadingInfo.kernel_tensors is {type(kernel).__name__}, not "
        "(parameters, buffers): weight_transfer/reload.py backs the old weights up from it"
    )
    params_, _ = kernel
    assert {n: t.data_ptr() for n, t in params_.items()} == {
        "weight": old["a.weight"][1],
        "bias": old["a.bias"][1],
    }, (
        "vLLM's kernel_tensors are no longer the tensors the forward pass used: "
        "weight_transfer/reload.py would back up (and restore) the wrong memory"
    )


def test_mtp_check():
    import importlib.util

    from vllm_ascend_rl.compat import mtp_check_off

    where = "compat.mtp_check_off turns it off for partial updates, as vLLM's engines"
    name = "vllm.model_executor.model_loader.mtp_validation"
    if importlib.util.find_spec(name) is None:  # vLLM 0.34: no completeness check to turn off
        with mtp_check_off():
            return
    from vllm.model_executor.model_loader import mtp_validation

    with mtp_check_off():
        assert not mtp_validation.is_mtp_completeness_check_enabled(), where
    assert mtp_validation.is_mtp_completeness_check_enabled(), where


def test_packed_modules():
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

    from vllm_ascend_rl.weight_transfer.validation import serving_layer

    mapping = getattr(Qwen2ForCausalLM, "packed_modules_mapping", None)
    assert mapping and mapping.get("qkv_proj") == ["q_proj", "k_proj", "v_proj"], (
        f"vLLM models' packed_modules_mapping changed ({mapping!r}): weight_transfer/"
        "engine.py (AscendRLEngine._vet) uses it to refuse updates that fill part of a fused layer"
    )
    assert serving_layer("m.0.attn.k_proj.weight", mapping) == "m.0.attn.qkv_proj"


# -- vLLM: workers and sleep -------------------------------------------------------------------
def test_memory_pool_hook():
    from npu_standin.worker import SleepableCPUWorker
    from vllm.v1.worker.cpu_worker import CPUWorker

    where = "npu_standin/worker.py overrides it to put only the KV cache in the sleep allocator"
    hook = getattr(CPUWorker, "_maybe_get_memory_pool_context", None)
    assert hook is not None, f"vLLM's worker lost _maybe_get_memory_pool_context: {where}"
    assert params(hook) == ["self", "tag"], f"its signature changed ({params(hook)}): {where}"
    call = r'self\._maybe_get_memory_pool_context\(\s*(tag\s*=\s*)?"kv_cache"\s*\)'
    assert re.search(call, source(CPUWorker.initialize_from_config)), (
        "vLLM's initialize_from_config no longer allocates the KV cache under "
        f'_maybe_get_memory_pool_context("kv_cache"): {where}; the KV cache would not sleep'
    )
    assert SleepableCPUWorker._maybe_get_memory_pool_context is not hook


def test_worker_rpcs():
    from vllm.device_allocator.sleep_mode_backend import SleepModeBackend
    from vllm.v1.worker.cpu_worker import CPUWorker

    # What the executor calls by name, and what our overrides pass on (worker/__init__.py,
    # npu_standin/worker.py; worker/npu_worker.py overrides the same names on NPUWorker).
    expected = {
        "sleep": ["self"],  # level has a default
        "wake_up": ["self"],
        "init_device": ["self"],
        "load_model": ["self"],  # ChipCPUWorker calls it with no arguments
        "initialize_from_config": ["self", "kv_cache_config"],
        "determine_available_memory": ["self"],
        "reload_weights": ["self"],
    }
    optional = {"sleep": "level", "wake_up": "tags"}
    if hasattr(SleepModeBackend, "discard"):  # vLLM >= 0.32 calls discard(tags) on workers
        expected["discard"] = ["self", "tags"]
    for name, wanted in expected.items():
        method = getattr(CPUWorker, name, None)
        assert method is not None, (
            f"vLLM's CPU worker lost {name}(): our sleepable workers override or wrap it"
        )
        assert required(method) == wanted, (
            f"vLLM's worker {name}{inspect.signature(method)} changed: our sleepable workers "
            "override it with the old parameters"
        )
        assert name not in optional or optional[name] in params(method), (
            f"vLLM's worker {name}() lost {optional[name]!r}: npu_standin/worker.py reads it"
        )


def test_worker_attributes():
    import importlib

    from vllm.v1.worker.gpu_worker import Worker

    for module in ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner"):  # 0.34
        try:
            GPUModelRunner = importlib.import_module(module).GPUModelRunner
            break
        except ImportError:
            continue
    else:
        raise AssertionError("vLLM's GPUModelRunner is in neither module: readiness.py reaches it")

    assert assigns(Worker.__init__, "weight_transfer_engine"), (
        "vLLM's worker no longer keeps self.weight_transfer_engine: worker/__init__.py "
        "(release_for_sleep) reads it"
    )
    assert callable(getattr(GPUModelRunner, "get_model", None)), (
        "vLLM's model runner lost get_model(): npu_standin/worker.py, worker/npu_worker.py "
        "and readiness.py (worker_readiness) reach the model through it"
    )


def test_drafter():
    import importlib

    from vllm.config import SpeculativeConfig

    runners = []
    for module in ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner"):  # 0.34
        try:
            runners.append(importlib.import_module(module).GPUModelRunner)
        except ImportError:
            continue
    assert runners and all(callable(getattr(r, "get_draft_model", None)) for r in runners), (
        "vLLM's model runner lost get_draft_model(): worker/ledger.py (drafter_model) finds the "
        "speculative-decoding drafter by it, for draft updates, the ledger and level-2 sleep"
    )
    assert "draft_model_config" in SpeculativeConfig.__dataclass_fields__, (
        "vLLM's SpeculativeConfig.draft_model_config is gone: worker/__init__.py "
        "(start_draft_weight_update) points the engine at the drafter with it"
    )


def test_kv_caches():
    import importlib

    runners = []
    for module in ("vllm.v1.worker.cpu_model_runner", "vllm.v1.worker.cpu.model_runner"):
        try:
            runners.append(importlib.import_module(module).CPUModelRunner)
        except ImportError:
            continue
    assert runners, "vLLM's CPU model runner moved: npu_standin/worker.py runs on it"
    for runner in runners:
        assert any(
            assigns(c, "kv_caches") for c in runner.__mro__ if c.__module__.startswith("vllm.")
        ), (
            f"vLLM's {runner.__module__}.CPUModelRunner no longer sets self.kv_caches: "
            "worker/ledger.py (kv_cache_tensors) finds the KV cache there to keep only it "
            "in the kv_cache sleep pool"
        )


def test_dp_index():
    from vllm.config import ParallelConfig

    config = ParallelConfig()
    assert getattr(config, "data_parallel_index", None) == config.data_parallel_rank, (
        "vLLM's ParallelConfig.data_parallel_index is gone or no longer the DP rank: "
        "device/__init__.py (worker_index) numbers engine workers by it, as vLLM's engines do"
    )


def test_cpu_linear():
    """The canary's wheel has no CPU kernels: its layer is on the meta device, which vLLM's
    dispatch gives a plain ``cpu_linear`` without packing."""
    from vllm.model_executor.layers import utils

    layer = torch.nn.Linear(64, 32, dtype=torch.bfloat16, device="meta" if CANARY else "cpu")
    utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
    assert callable(getattr(layer, "cpu_linear", None)), (
        "vLLM's CPU linear layers no longer keep their packed kernel in layer.cpu_linear: "
        "npu_standin/worker.py (_discard_packed_linears) frees it at level-2 sleep"
    )
    layer.cpu_linear = lambda x, weight, bias: "ours"
    assert utils.cpu_unquantized_gemm(layer, None, layer.weight) == "ours", (
        "vLLM's CPU GEMM no longer calls layer.cpu_linear: npu_standin/worker.py's refusal "
        "after a level-2 sleep would not run, and weight_transfer/reload.py restores it"
    )


def test_checksum_methods():
    from vllm.v1.worker.gpu_worker import Worker

    where = "compat.weight_checker_methods lends them to worker/npu_worker.py"
    present = [n for n in compat.WEIGHT_CHECKER_METHODS if n in vars(Worker)]
    if not present:  # vLLM 0.30.0: no /weight_checker, nothing to lend
        assert compat.weight_checker_methods(object) == {}
        return
    assert present == list(compat.WEIGHT_CHECKER_METHODS), (
        f"vLLM's GPU Worker has only {present} of {compat.WEIGHT_CHECKER_METHODS}: {where}"
    )
    assert "self._weight_checksum_prefix()" in source(Worker.compute_weight_checksums), (
        f"vLLM's compute_weight_checksums no longer calls _weight_checksum_prefix: {where}"
    )
    read = set()
    for name in present:
        tree = ast.parse(source(getattr(Worker, name)))
        read |= {
            node.attr
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and getattr(node.value, "id", None) == "self"
        }
    assert read <= {"parallel_config", "model_runner", "_weight_checksum_prefix"}, (
        f"vLLM's weight-checker methods now read self.{sorted(read)}: {where}, whose "
        "NPUWorker may not have them"
    )


def test_sleep_mode_backend(tiny_model):
    from vllm.config import ModelConfig

    from vllm_ascend_rl._registration import CAMEM_BACKEND
    from vllm_ascend_rl.sleep.backend import CaMemSleepBackend
    from vllm_ascend_rl.worker import attach_sleep_backend

    model_config = ModelConfig(model=str(tiny_model), dtype="bfloat16", max_model_len=256)
    assert getattr(model_config, "sleep_mode_backend", None) == "cumem", (
        "vLLM's ModelConfig.sleep_mode_backend is gone or changed its default: "
        "worker/__init__.py (attach_sleep_backend) selects ours through it"
    )
    parallel = types.SimpleNamespace(data_parallel_index=0, world_size=1, rank=0)
    config = types.SimpleNamespace(
        model_config=model_config, parallel_config=parallel, instance_id="test"
    )
    worker = types.SimpleNamespace(vllm_config=config)
    backend = attach_sleep_backend(worker)
    assert isinstance(backend, CaMemSleepBackend), (
        "vLLM's SleepModeBackendFactory.create_backend no longer builds the backend "
        "model_config.sleep_mode_backend names: worker/__init__.py (attach_sleep_backend)"
    )
    assert model_config.sleep_mode_backend == CAMEM_BACKEND


# -- torch and the standard library ------------------------------------------------------------
def test_storage_use_count():
    from vllm_ascend_rl.weight_transfer.buckets import storage_use_count

    where = "buckets.py (ReceivePool) and npu_ipc.py tell a buffer in use from an idle one"
    buffer = torch.empty(16, dtype=torch.uint8)
    idle = storage_use_count(buffer)
    assert idle is not None, f"torch._C._storage_Use_Count or storage._cdata is gone: {where}"
    view = buffer[:8].view(2, 4)
    assert storage_use_count(buffer) == idle + 1, f"a live view no longer counts: {where}"
    del view
    assert storage_use_count(buffer) == idle, f"a dead view still counts: {where}"


def test_c10d_group():
    from torch.distributed import Backend, ProcessGroup
    from torch.distributed.distributed_c10d import ProcessGroupGloo
    from torch.distributed.rendezvous import rendezvous

    where = "device/group.py (open_group) and device/npu.py build our group with it"
    for owner, name in (
        (ProcessGroup, "_set_default_backend"),
        (ProcessGroup, "_register_backend"),
        (ProcessGroup, "_get_backend"),
        (ProcessGroupGloo, "_set_sequence_number_for_group"),
    ):
        assert callable(getattr(owner, name, None)), (
            f"torch's {owner.__name__}.{name} is gone: {where}"
        )
    assert isinstance(Backend.backend_type_map, dict) and callable(rendezvous), where
    # That such a group broadcasts, times out and breaks: tests/unit/test_channel.py.


def test_resource_tracker():
    if "track" in inspect.signature(shared_memory.SharedMemory).parameters:
        return  # Python >= 3.13: npu_standin/device.py (_attach) passes track=False instead
    where = "npu_standin/device.py (_attach) keeps this process from unlinking a trainer's segment"
    assert params(resource_tracker.unregister) == ["name", "rtype"], (
        f"multiprocessing.resource_tracker.unregister changed: {where}"
    )
    shm = shared_memory.SharedMemory(create=True, size=8)
    try:
        assert getattr(shm, "_name", "").lstrip("/") == shm.name, (
            f"SharedMemory._name is gone or no longer the tracked name: {where}"
        )
    finally:
        shm.close()
        shm.unlink()


# -- vLLM: operator tools -----------------------------------------------------------------------
def test_factory_registry():
    from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    import vllm_ascend_rl
    from vllm_ascend_rl.sleep.backend import CaMemSleepBackend

    vllm_ascend_rl.register()
    where = "doctor/local.py (_factory_entry) reads whom a name resolves to"
    for factory in (WeightTransferEngineFactory, WeightTransferTrainerFactory):
        assert isinstance(vars(factory).get("_registry"), dict), (
            f"{factory} lost _registry: {where}"
        )
    loader = SleepModeBackendFactory._registry["ascend_rl_camem"]
    assert loader() is CaMemSleepBackend, f"a _registry value no longer loads the class: {where}"


def test_instance_id(tiny_model):
    import pickle

    from vllm.config import ModelConfig, VllmConfig

    config = VllmConfig(model_config=ModelConfig(model=str(tiny_model), max_model_len=256))
    where = "metrics.py (engine_worker) and stat_logger.py find the counters directory by it"
    assert config.instance_id, f"VllmConfig.instance_id is empty: {where}"
    assert pickle.loads(pickle.dumps(config)).instance_id == config.instance_id, (
        f"VllmConfig.instance_id changes when the config travels to an engine process: {where}"
    )


def test_prometheus_registry(monkeypatch):
    from prometheus_client import REGISTRY
    from vllm.v1.metrics.prometheus import get_prometheus_registry

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    assert get_prometheus_registry() is REGISTRY, (
        "vLLM's /metrics no longer serves prometheus_client's REGISTRY in a single API "
        "server: stat_logger.py registers the engine's counters there"
    )
