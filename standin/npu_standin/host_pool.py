"""The CPU stand-in for torch_npu's pluggable-allocator pool: inside the block, plain CPU
``torch.zeros``/``torch.empty`` (ordinary contiguous tensors only; anything else falls through
to torch) are served from the sleep allocator (host back end), freed when the tensor's last
view dies."""

from __future__ import annotations

import ctypes
import math
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from vllm_ascend_rl.device.base import SleepPool
from vllm_ascend_rl.logs import get_logger

logger = get_logger(__name__)

_SERVED = (torch.zeros, torch.empty)
_KNOWN_KWARGS = {"size", "dtype", "device", "layout", "pin_memory", "requires_grad"}


def host_tensor(
    pool: SleepPool, alloc: Any, nbytes: int | None = None, owned: bool = False
) -> torch.Tensor:
    """A uint8 CPU tensor over a host-back-end allocation of ``pool``. ``owned``: the
    allocation is freed when the tensor's last view dies; otherwise the caller frees it."""
    size = alloc.size if nbytes is None else nbytes
    array = (ctypes.c_uint8 * size).from_address(alloc.addr)
    if owned:
        weakref.finalize(array, _free_quietly, pool, alloc.addr, alloc.id).atexit = False
    return torch.frombuffer(array, dtype=torch.uint8)


def _free_quietly(pool: SleepPool, addr: int, id_: int) -> None:
    """Free the entry ``id_`` if it is still at ``addr`` (a pooled CPU tensor died)."""
    try:
        pool.free(addr, id_)
    except KeyError:  # freed already
        pass
    except Exception as e:
        logger.warning("freeing a pooled CPU tensor at 0x%x failed: %s", addr, e)


class HostAllocationMode(TorchFunctionMode):
    def __init__(self, pool: SleepPool, tag: str) -> None:
        super().__init__()
        self.pool, self.tag = pool, tag

    def __torch_function__(
        self, func: Callable[..., Any], types: object, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        shape = _servable_shape(func, args, kwargs)
        if shape is not None:
            dtype = kwargs.get("dtype") or torch.get_default_dtype()
            nbytes = math.prod(shape) * dtype.itemsize
            if nbytes > 0:
                alloc = self.pool.allocate(nbytes, self.tag)
                return host_tensor(self.pool, alloc, nbytes, owned=True).view(dtype).view(shape)
        return func(*args, **kwargs)


def _servable_shape(func: object, args: tuple, kwargs: dict[str, Any]) -> tuple[int, ...] | None:
    """The requested shape if this call is one the pool serves, else None."""
    if func not in _SERVED or set(kwargs) - _KNOWN_KWARGS:
        return None
    if kwargs.get("pin_memory") or kwargs.get("requires_grad"):
        return None
    if kwargs.get("layout") not in (None, torch.strided):
        return None
    device = kwargs.get("device")
    if device is not None and torch.device(device).type != "cpu":
        return None
    if "size" in kwargs:
        if args:
            return None
        size = kwargs["size"]
    else:
        size = args[0] if len(args) == 1 and isinstance(args[0], list | tuple) else args
    try:
        shape = tuple(int(d) for d in size)
    except (TypeError, ValueError):
        return None
    return shape if all(d >= 0 for d in shape) else None
