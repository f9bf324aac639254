"""CaMemAllocator: tagged allocations that sleep and wake at the same virtual addresses.

Every allocation reserves its own virtual address range once. Sleeping unmaps and frees the
physical memory behind it (after copying tagged contents to a host backup that is allocated
once and reused across cycles); waking maps fresh physical memory at the same address and
restores the backup (or leaves it zero-filled). Tensors, views and captured graphs keep
pointing at valid addresses throughout.

Back ends (``vllm_ascend_rl._C``): ``acl`` on Ascend (CANN virtual memory, fed by torch_npu's
pluggable allocator) and ``host`` everywhere (memfd + mmap), which CPU workers and the tests use.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from vllm_ascend_rl.device import Device, get_device

DEFAULT_TAG = "default"


class SleepError(RuntimeError):
    """A sleep, wake or allocation failed; the allocator is left in a consistent state."""


@dataclass
class Allocation:
    addr: int
    size: int  # bytes, a multiple of the back end's granularity
    tag: str
    device: int = 0
    handle: int | None = None  # physical memory; None while asleep
    backup: torch.Tensor | None = None  # host copy, allocated once, reused every cycle
    has_backup: bool = False  # the backup holds this allocation's contents right now

    @property
    def awake(self) -> bool:
        return self.handle is not None


def _vmm():
    from vllm_ascend_rl import _C

    return _C


class CaMemAllocator:
    """A singleton per process (``get_instance``): the ACL back end's C entry points call back
    into exactly one allocator."""

    _instance: CaMemAllocator | None = None
    _lock = threading.Lock()

    @classmethod
    def get_instance(cls, backend: str | None = None) -> CaMemAllocator:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls(backend or _default_backend())
            return cls._instance

    def __init__(self, backend: str = "host", vmm: Any = None) -> None:
        self.vmm = vmm or _vmm()
        if backend not in self.vmm.backends():
            raise SleepError(
                f"VMM back end {backend!r} is not available (built: {self.vmm.backends()})"
            )
        if backend == "acl":
            _refuse_expandable_segments()
        self.backend = backend
        self.allocations: dict[int, Allocation] = {}
        self._granularity: dict[int, int] = {}

    @property
    def device(self) -> Device:
        """The device whose memory this back end maps."""
        return get_device("cpu" if self.backend == "host" else "npu")

    # -- allocation ------------------------------------------------------------------
    def granularity(self, device: int = 0) -> int:
        if device not in self._granularity:
            self._granularity[device] = self._call("granularity", self.backend, device)
        return self._granularity[device]

    def allocate(
        self, nbytes: int, tag: str = DEFAULT_TAG, device: int = 0, populate: bool = True
    ) -> Allocation:
        """Reserve, back and map ``nbytes`` (rounded up to the granularity).

        ``populate`` commits the memory now, so running out of it is an exception here.
        """
        gran = self.granularity(device)
        size = max(gran, (nbytes + gran - 1) // gran * gran)
        addr = self._call("reserve", self.backend, size)
        try:
            handle = self._call("create", self.backend, size, device, populate)
        except SleepError:
            self.vmm.release(self.backend, addr, size)
            raise
        try:
            self._call("map", self.backend, addr, size, handle, populate)
        except SleepError:
            self.vmm.free(self.backend, handle)
            self.vmm.release(self.backend, addr, size)
            raise
        alloc = Allocation(addr, size, tag, device, handle)
        self.allocations[addr] = alloc
        return alloc

    def tensor(self, alloc: Allocation, nbytes: int | None = None) -> torch.Tensor:
        """A uint8 CPU tensor over a host-back-end allocation (it does not own the memory)."""
        if self.backend != "host":
            raise SleepError("CPU tensors exist only for the host back end")
        n = alloc.size if nbytes is None else nbytes
        return torch.frombuffer((ctypes.c_uint8 * n).from_address(alloc.addr), dtype=torch.uint8)

    def free(self, addr: int) -> None:
        alloc = self.allocations.pop(addr)
        if alloc.awake:
            self.vmm.unmap(self.backend, alloc.addr, alloc.size)
            self.vmm.free(self.backend, alloc.handle)
        self.vmm.release(self.backend, alloc.addr, alloc.size)

    # The ACL back end's C entry points report allocations made through torch_npu's pool.
    def _on_malloc(self, device: int, size: int, addr: int, handle: int) -> None:
        self.allocations[addr] = Allocation(addr, size, self._current_tag, device, handle)

    def _on_free(self, addr: int) -> tuple[int, int, bool]:
        alloc = self.allocations.pop(addr)
        return alloc.size, alloc.handle or 0, alloc.awake

    _current_tag = DEFAULT_TAG

    @contextmanager
    def use_memory_pool(self, tag: str = DEFAULT_TAG) -> Iterator[None]:
        """Every tensor allocated inside is tagged ``tag``.

        Ascend: torch_npu's pluggable-allocator pool routes allocations through the ACL
        back end. CPU: ``torch.zeros``/``torch.empty`` on the CPU inside the block are served
        from host virtual memory (this is how the CPU worker places its KV cache).
        """
        previous, self._current_tag = self._current_tag, tag
        try:
            if self.backend == "acl":
                from vllm_ascend_rl.device.npu import pluggable_pool

                with pluggable_pool(self):
                    yield
            else:
                with _HostAllocationMode(self, tag):
                    yield
        finally:
            self._current_tag = previous

    # -- sleep / wake ----------------------------------------------------------------
    def sleep(self, offload_tags: Iterable[str] | str | None = None) -> None:
        """Back up allocations tagged ``offload_tags`` to host memory, then release the
        physical memory of every awake allocation. Addresses stay reserved."""
        offload = _tags(offload_tags) or set()
        hw = self.device
        for alloc in self.allocations.values():
            if not alloc.awake:
                continue
            if alloc.tag in offload:
                if alloc.backup is None:  # allocated once, reused every cycle
                    alloc.backup = torch.empty(
                        alloc.size, dtype=torch.uint8, pin_memory=self.backend == "acl"
                    )
                hw.read_device(alloc.addr, alloc.backup)
                alloc.has_backup = True
            else:
                alloc.has_backup = False
            self._release_physical(alloc)

    def wake_up(self, tags: Iterable[str] | str | None = None) -> None:
        """Map fresh physical memory at the same addresses for ``tags`` (all if None) and
        restore backups. Awake allocations are left alone. A failure part-way releases what
        this call had mapped and raises: the allocator is back to a clean asleep state."""
        wanted = _tags(tags)
        hw = self.device
        woken: list[Allocation] = []
        try:
            for alloc in self.allocations.values():
                if alloc.awake or (wanted is not None and alloc.tag not in wanted):
                    continue
                alloc.handle = self._call("create", self.backend, alloc.size, alloc.device, False)
                woken.append(alloc)
                try:
                    self._call("map", self.backend, alloc.addr, alloc.size, alloc.handle, False)
                except SleepError:
                    self.vmm.free(self.backend, alloc.handle)
                    alloc.handle = None
                    woken.pop()
                    raise
                if alloc.has_backup:
                    hw.write_device(alloc.addr, alloc.backup)
        except SleepError as e:
            for alloc in woken:
                self._release_physical(alloc)
            raise SleepError(
                f"wake_up({sorted(wanted) if wanted else 'all'}) failed and was rolled back: {e}"
            ) from e
        for alloc in woken:
            alloc.has_backup = False

    def discard(self, tags: Iterable[str] | str) -> None:
        """Release ``tags`` without keeping their contents; they wake zero-filled."""
        wanted = _tags(tags) or set()
        for alloc in self.allocations.values():
            if alloc.awake and alloc.tag in wanted:
                alloc.has_backup = False
                self._release_physical(alloc)

    def get_current_usage(self) -> int:
        """Bytes of physical memory currently held."""
        return sum(a.size for a in self.allocations.values() if a.awake)

    def is_awake(self, tag: str) -> bool:
        return all(a.awake for a in self.allocations.values() if a.tag == tag)

    def tags(self) -> set[str]:
        return {a.tag for a in self.allocations.values()}

    # -- helpers ---------------------------------------------------------------------
    def _release_physical(self, alloc: Allocation) -> None:
        self._call("unmap", self.backend, alloc.addr, alloc.size)
        self._call("free", self.backend, alloc.handle)
        alloc.handle = None

    def _call(self, op: str, *args):
        try:
            return getattr(self.vmm, op)(*args)
        except self.vmm.VmmError as e:
            code, message = e.args[:2] if len(e.args) >= 2 else (None, str(e))
            raise SleepError(f"{self.backend} VMM {op} failed (code {code}): {message}") from e


class _HostAllocationMode(TorchFunctionMode):
    """Serve ``torch.zeros``/``torch.empty`` on the CPU from the allocator, tagged."""

    def __init__(self, allocator: CaMemAllocator, tag: str) -> None:
        super().__init__()
        self.allocator, self.tag = allocator, tag

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (
            func in (torch.zeros, torch.empty)
            and _on_cpu(kwargs)
            and not kwargs.get("pin_memory")
            and not kwargs.get("requires_grad")
        ):
            shape = args[0] if len(args) == 1 and isinstance(args[0], list | tuple) else args
            dtype = kwargs.get("dtype") or torch.get_default_dtype()
            numel = 1
            for d in shape:
                numel *= int(d)
            nbytes = numel * dtype.itemsize
            if nbytes > 0:
                alloc = self.allocator.allocate(nbytes, self.tag)  # zero-filled memory
                flat = self.allocator.tensor(alloc, nbytes)
                return flat.view(dtype).view(tuple(int(d) for d in shape))
        return func(*args, **kwargs)


def _on_cpu(kwargs: dict) -> bool:
    device = kwargs.get("device")
    return device is None or torch.device(device).type == "cpu"


def _tags(tags: Iterable[str] | str | None) -> set[str] | None:
    if tags is None:
        return None
    return {tags} if isinstance(tags, str) else set(tags)


def _default_backend() -> str:
    from vllm_ascend_rl.device import current_device

    return "acl" if current_device().kind == "npu" else "host"


def _refuse_expandable_segments() -> None:
    conf = os.environ.get("PYTORCH_NPU_ALLOC_CONF", "")
    if "expandable_segments:true" in conf.replace(" ", "").lower():
        raise SleepError(
            "sleep mode needs PYTORCH_NPU_ALLOC_CONF without expandable_segments:True "
            f"(it is {conf!r}): expandable segments map memory outside the sleep allocator, "
            "which then cannot release it. Set expandable_segments:False or unset it."
        )
