"""The address ledger: where a captured graph (ACL graphs on NPU, CUDA graphs upstream) reads.
A graph replays the device addresses it captured, so every parameter, buffer, derived tensor
(a tensor a module keeps as a plain attribute: a repacked, transposed or upcast copy of a
weight, a scale) and KV cache tensor must stay where it was when the engine started. Our
workers record the ledger once start-up (and graph capture) is done; ``moved_addresses`` over
``/collective_rpc`` names what moved since. Any vLLM worker gets both methods with
``--worker-extension-cls vllm_ascend_rl.worker.ledger.AddressLedger`` (its start is then the
first ``moved_addresses`` call)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from vllm_ascend_rl.weight_transfer.reload import plain_tensors


def kv_cache_tensors(model_runner: Any) -> Iterator[torch.Tensor]:
    """Every tensor in the runner's ``kv_caches`` (nested lists/tuples in vllm-ascend)."""
    stack = [getattr(model_runner, "kv_caches", [])]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            yield item
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)


def drafter_model(model_runner: Any) -> torch.nn.Module | None:
    """The speculative-decoding drafter's module, if the runner has one (vLLM's
    ``get_draft_model``; vllm-ascend's runner keeps it as ``drafter.model``, 182b75e
    ``spec_decode/llm_base_proposer.py:290``)."""
    get = getattr(model_runner, "get_draft_model", None)
    model = (
        get() if callable(get) else getattr(getattr(model_runner, "drafter", None), "model", None)
    )
    return model if isinstance(model, torch.nn.Module) else None


def served_modules(model_runner: Any) -> Iterator[tuple[str, torch.nn.Module]]:
    """Every module a step runs, by path: the served model's, then its speculative-decoding
    drafter's (under ``draft.``)."""
    yield from model_runner.get_model().named_modules()
    drafter = drafter_model(model_runner)
    if drafter is not None:
        yield from drafter.named_modules(prefix="draft")


def address_ledger(
    modules: Iterable[tuple[str, torch.nn.Module]], kv_caches: Iterable[torch.Tensor]
) -> dict[str, int]:
    """``kind:name`` -> data address, for every tensor a forward pass reads, of ``modules``
    (path, module) and the KV cache."""
    ledger: dict[str, int] = {}
    for path, module in modules:
        prefix = f"{path}." if path else ""
        for kind, tensors in (("parameter", module._parameters), ("buffer", module._buffers)):
            for name, t in tensors.items():
                if t is not None:
                    ledger[f"{kind}:{prefix}{name}"] = t.data_ptr()
        for name, t in plain_tensors(module):
            ledger[f"derived:{prefix}{name}"] = t.data_ptr()
    for i, t in enumerate(kv_caches):
        ledger[f"kv_cache:{i}"] = t.data_ptr()
    return ledger


def moved(start: dict[str, int], now: dict[str, int]) -> dict[str, list[int | None]]:
    """Every entry whose address changed, appeared or vanished: name -> [start, now]."""
    return {
        name: [start.get(name), now.get(name)]
        for name in start.keys() | now.keys()
        if start.get(name) != now.get(name)
    }


class AddressLedger:
    """Worker methods (``/collective_rpc``): ``address_ledger`` and ``moved_addresses``."""

    model_runner: Any
    _start_addresses: dict[str, int] | None = None

    def address_ledger(self) -> dict[str, int]:
        runner = self.model_runner
        return address_ledger(served_modules(runner), kv_cache_tensors(runner))

    def moved_addresses(self) -> dict[str, list[int | None]]:
        """Since start-up; {} while every tensor is where the engine started with it."""
        now = self.address_ledger()
        if self._start_addresses is None:
            self._start_addresses = now
        return moved(self._start_addresses, now)


class StartupAddressLedger(AddressLedger):
    """The plugin's workers: the start is the end of start-up, once graphs are captured."""

    def compile_or_warm_up_model(self, *args: Any, **kwargs: Any) -> Any:
        out = super().compile_or_warm_up_model(*args, **kwargs)  # type: ignore[misc]
        self._start_addresses = self.address_ledger()
        return out
