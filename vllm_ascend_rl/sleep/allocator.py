"""CaMemAllocator: tagged allocations that sleep and wake at the same virtual addresses.

Every allocation reserves its own virtual address range once. Sleeping drains the device,
copies tagged contents to a host backup (allocated once and reused across cycles, unless
``keep_backups`` is off) and unmaps and frees the physical memory; waking maps fresh physical
memory at the same address and restores the backup. Memory woken without a backup reads as
zero on every back end: fresh anonymous pages are zero, ACL memory is zeroed after mapping. Tensors,
views and captured graphs keep pointing at valid addresses throughout. Allocations tagged
``sleep_persistent`` are never released.

Back ends (``vllm_ascend_rl._C``): ``acl`` on Ascend (CANN virtual memory, fed by torch_npu's
pluggable allocator) and ``host`` everywhere (anonymous mmap), which CPU workers and the tests
use.
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from vllm_ascend_rl.device import Device, get_device
from vllm_ascend_rl.logs import get_logger

logger = get_logger(__name__)

DEFAULT_TAG = "default"
PERSISTENT_TAG = "sleep_persistent"  # never released by sleep or discard


class SleepError(RuntimeError):
    """A sleep, wake or allocation failed; the allocator is left in a consistent state."""


@dataclass
class Allocation:
    addr: int
    size: int  # bytes, a multiple of the back end's granularity
    tag: str
    device: int = 0
    handle: int | None = None  # physical memory; None while asleep
    mapped: bool = False  # physical memory is mapped at addr
    backup: torch.Tensor | None = None  # host copy, allocated once, reused every cycle
    has_backup: bool = False  # the backup holds this allocation's contents right now

    @property
    def awake(self) -> bool:
        return self.mapped


def _vmm():
    from vllm_ascend_rl import _C

    return _C


class CaMemAllocator:
    """A singleton per process (``get_instance``): the C entry points of the pluggable pool
    call back into exactly one allocator. Every method is thread-safe."""

    _instance: CaMemAllocator | None = None
    _instance_lock = threading.Lock()

    @classmethod
    def get_instance(cls, backend: str | None = None, device: int = 0) -> CaMemAllocator:
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = cls(backend or _default_backend(), device=device)
            return cls._instance

    def __init__(
        self,
        backend: str = "host",
        vmm: Any = None,
        device: int = 0,
        keep_backups: bool | None = None,
    ) -> None:
        self.vmm = vmm or _vmm()
        if backend not in self.vmm.backends():
            raise SleepError(
                f"VMM back end {backend!r} is not available (built: {self.vmm.backends()})"
            )
        if backend == "acl":
            check_npu_alloc_conf()
        self.backend = backend
        self.device_index = device
        self.maps_zeroed = bool(self.vmm.maps_zeroed(backend))
        # Backups of offloaded tags stay allocated across cycles (one allocation, not one per
        # sleep); a colocated trainer that wants that host memory back can turn this off.
        if keep_backups is None:
            keep_backups = os.environ.get("VLLM_ASCEND_RL_SLEEP_KEEP_BACKUPS", "1") != "0"
        self.keep_backups = keep_backups
        self.allocations: dict[int, Allocation] = {}
        self._granularity: dict[int, int] = {}
        self._lock = threading.RLock()

    @property
    def device(self) -> Device:
        """The device whose memory this allocator maps."""
        return self._hw(self.device_index)

    def _hw(self, index: int) -> Device:
        return get_device("cpu" if self.backend == "host" else "npu", index)

    # -- allocation ------------------------------------------------------------------
    def granularity(self, device: int | None = None) -> int:
        device = self.device_index if device is None else device
        if device not in self._granularity:
            self._granularity[device] = self._call("granularity", self.backend, device)
        return self._granularity[device]

    def allocate(
        self, nbytes: int, tag: str = DEFAULT_TAG, device: int | None = None, populate: bool = True
    ) -> Allocation:
        """Reserve, back and map ``nbytes`` (rounded up to the granularity).

        ``populate`` commits the memory now, so running out of it is an exception here.
        """
        device = self.device_index if device is None else device
        gran = self.granularity(device)
        size = max(gran, (nbytes + gran - 1) // gran * gran)
        with self._lock:
            addr = self._call("reserve", self.backend, size, device)
            alloc = Allocation(addr, size, tag, device)
            try:
                alloc.handle = self._call("create", self.backend, size, device, populate)
                self._call("map", self.backend, addr, size, alloc.handle, populate, device)
                alloc.mapped = True
            except SleepError:
                self._undo(alloc)
                raise
            self.allocations[addr] = alloc
            return alloc

    def tensor(self, alloc: Allocation, nbytes: int | None = None, owned: bool = False):
        """A uint8 CPU tensor over a host-back-end allocation. ``owned``: the allocation is
        freed when the tensor's last view dies; otherwise the caller frees it."""
        if self.backend != "host":
            raise SleepError("CPU tensors exist only for the host back end")
        array = (ctypes.c_uint8 * (alloc.size if nbytes is None else nbytes)).from_address(
            alloc.addr
        )
        if owned:
            weakref.finalize(array, self._free_quietly, alloc.addr).atexit = False
        return torch.frombuffer(array, dtype=torch.uint8)

    def free(self, addr: int) -> None:
        """Release the allocation at ``addr`` whatever its state. It is forgotten only once
        everything behind it is released, so a failure leaves it known, not leaked."""
        with self._lock:
            alloc = self.allocations[addr]
            self._release_physical(alloc)
            self._call("release", self.backend, alloc.addr, alloc.size, alloc.device)
            del self.allocations[addr]

    def _free_quietly(self, addr: int) -> None:
        try:
            if addr in self.allocations:
                self.free(addr)
        except SleepError as e:
            logger.warning("freeing a pooled CPU tensor at 0x%x failed: %s", addr, e)

    # The pluggable pool's C entry points (vmm_entry.cpp) report allocations made through it.
    def _on_malloc(self, device: int, size: int, addr: int, handle: int) -> None:
        with self._lock:
            self.allocations[addr] = Allocation(
                addr, size, self._current_tag, device, handle, mapped=True
            )

    def _on_free(self, addr: int) -> tuple[int, int, bool]:
        with self._lock:
            alloc = self.allocations.pop(addr)
            return alloc.size, alloc.handle or 0, alloc.mapped

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
                from vllm_ascend_rl.sleep.host_pool import HostAllocationMode

                with HostAllocationMode(self, tag):
                    yield
        finally:
            self._current_tag = previous

    def keep_only(self, tag: str, tensors: Iterable[torch.Tensor]) -> int:
        """Re-tag ``sleep_persistent`` every allocation of ``tag`` that backs none of
        ``tensors``; return how many. A pool entered around a whole initialization step
        also catches its bookkeeping buffers, which must not be released with the KV cache."""
        starts = [t.untyped_storage().data_ptr() for t in tensors if t.numel()]
        moved = 0
        with self._lock:
            for alloc in self.allocations.values():
                if alloc.tag == tag and not any(
                    alloc.addr <= p < alloc.addr + alloc.size for p in starts
                ):
                    alloc.tag = PERSISTENT_TAG
                    moved += 1
        if moved:
            logger.info("%d %s allocation(s) hold no KV cache: kept across sleep", moved, tag)
        return moved

    # -- sleep / wake ----------------------------------------------------------------
    def sleep(self, offload_tags: Iterable[str] | str | None = None) -> None:
        """Back up allocations tagged ``offload_tags`` to host memory, then release the
        physical memory of every awake allocation (but ``sleep_persistent``). Addresses stay
        reserved. The device is drained first: queued work could otherwise write after the
        backup, or touch memory already unmapped."""
        offload = _tags(offload_tags) or set()
        with self._lock:
            victims = [a for a in self.allocations.values() if a.awake and a.tag != PERSISTENT_TAG]
            self._drain(victims)
            for alloc in victims:
                if alloc.tag in offload:
                    if alloc.backup is None:
                        alloc.backup = torch.empty(
                            alloc.size, dtype=torch.uint8, pin_memory=self.backend == "acl"
                        )
                    self._hw(alloc.device).read_device(alloc.addr, alloc.backup)
                    alloc.has_backup = True
                else:
                    alloc.has_backup = False
                self._release_physical(alloc)

    def wake_up(self, tags: Iterable[str] | str | None = None) -> None:
        """Map fresh, populated physical memory at the same addresses for ``tags`` (all if
        None) and restore backups; what has no backup reads as zero. Awake allocations are
        left alone. A failure of any kind part-way releases what this call had mapped and raises
        SleepError: the allocator is back to a clean asleep state, backups intact."""
        wanted = _tags(tags)
        with self._lock:
            woken: list[Allocation] = []
            try:
                for alloc in list(self.allocations.values()):
                    if alloc.awake or (wanted is not None and alloc.tag not in wanted):
                        continue
                    # Populated: the memory is committed and mapped now, so a shortage fails
                    # this wake (rolled back) instead of a later page fault, and the first
                    # forward pass does not pay the page faults (ACL maps eagerly anyway).
                    alloc.handle = self._call(
                        "create", self.backend, alloc.size, alloc.device, True
                    )
                    woken.append(alloc)
                    self._call(
                        "map", self.backend, alloc.addr, alloc.size, alloc.handle, True,
                        alloc.device,
                    )  # fmt: skip
                    alloc.mapped = True
                    if alloc.has_backup:
                        self._hw(alloc.device).write_device(alloc.addr, alloc.backup)
                    elif not self.maps_zeroed:
                        self._call("zero", self.backend, alloc.addr, alloc.size, alloc.device)
            except Exception as e:
                for alloc in woken:
                    self._undo_wake(alloc)
                raise SleepError(
                    f"wake_up({sorted(wanted) if wanted else 'all'}) failed and was rolled "
                    f"back: {type(e).__name__}: {e}"
                ) from e
            for alloc in woken:
                alloc.has_backup = False
                if not self.keep_backups:
                    alloc.backup = None

    def discard(self, tags: Iterable[str] | str) -> None:
        """Release ``tags`` without keeping their contents; they wake zero-filled. An
        allocation already asleep with a backup loses that backup too (it would otherwise
        come back with contents older than the discard)."""
        wanted = _tags(tags) or set()
        with self._lock:
            chosen = [
                a for a in self.allocations.values() if a.tag in wanted and a.tag != PERSISTENT_TAG
            ]
            self._drain([a for a in chosen if a.awake])
            for alloc in chosen:
                if alloc.awake:
                    alloc.has_backup = False
                    self._release_physical(alloc)
                elif alloc.has_backup:
                    logger.warning(
                        "discard(%s): dropping the sleep backup of 0x%x", alloc.tag, alloc.addr
                    )
                    alloc.has_backup = False
                    alloc.backup = None

    def get_current_usage(self) -> int:
        """Bytes of physical memory currently held."""
        with self._lock:
            return sum(a.size for a in self.allocations.values() if a.awake)

    def is_awake(self, tag: str) -> bool:
        with self._lock:
            return all(a.awake for a in self.allocations.values() if a.tag == tag)

    def tags(self) -> set[str]:
        with self._lock:
            return {a.tag for a in self.allocations.values()}

    # -- helpers ---------------------------------------------------------------------
    def _drain(self, allocations: Iterable[Allocation]) -> None:
        for index in sorted({a.device for a in allocations}):
            self._hw(index).synchronize()

    def _release_physical(self, alloc: Allocation) -> None:
        """Unmap, then free. Each step is recorded as soon as it succeeds, and a handle is
        never freed twice: a failed free is reported, not retried (a host handle is a file
        descriptor the kernel recycles)."""
        if alloc.mapped:
            self._call("unmap", self.backend, alloc.addr, alloc.size, alloc.device)
            alloc.mapped = False
        if alloc.handle is not None:
            handle, alloc.handle = alloc.handle, None
            self._call("free", self.backend, handle, alloc.device)

    def _undo_wake(self, alloc: Allocation) -> None:
        try:
            self._release_physical(alloc)
        except SleepError as e:  # reported; the original failure is what the caller sees
            logger.error("rolling back a failed wake at 0x%x: %s", alloc.addr, e)

    def _undo(self, alloc: Allocation) -> None:
        """Give back a half-made allocation (best effort; the first error is the caller's)."""
        self._undo_wake(alloc)
        try:
            self._call("release", self.backend, alloc.addr, alloc.size, alloc.device)
        except SleepError as e:
            logger.error("releasing 0x%x after a failed allocation: %s", alloc.addr, e)

    def _call(self, op: str, *args):
        try:
            return getattr(self.vmm, op)(*args)
        except self.vmm.VmmError as e:
            code, message = e.args[:2] if len(e.args) >= 2 else (None, str(e))
            raise SleepError(f"{self.backend} VMM {op} failed (code {code}): {message}") from e


def _tags(tags: Iterable[str] | str | None) -> set[str] | None:
    if tags is None:
        return None
    return {tags} if isinstance(tags, str) else set(tags)


def _default_backend() -> str:
    from vllm_ascend_rl.device import device_kind

    return "acl" if device_kind() == "npu" else "host"


def check_npu_alloc_conf() -> None:
    """Refuse torch_npu allocator settings under which it maps or frees pool memory behind
    our back: expandable segments (its expandable branch runs before the pool branch,
    NPUCachingAllocator.cpp:2773-2790 in torch_npu v2.10.0) and ``max_split_size_mb`` (its
    OOM retry releases cached blocks of the current pool with a plain ``aclrtFree``,
    ``:2840-2887``, ``:2965-2981``)."""
    conf = os.environ.get("PYTORCH_NPU_ALLOC_CONF", "").replace(" ", "").lower()
    if "expandable_segments:true" in conf:
        raise SleepError(
            "sleep mode needs PYTORCH_NPU_ALLOC_CONF without expandable_segments:True "
            f"(it is {conf!r}): expandable segments map memory outside the sleep allocator, "
            "which then cannot release it. Set expandable_segments:False or unset it."
        )
    if "max_split_size_mb" in conf:
        raise SleepError(
            f"sleep mode needs PYTORCH_NPU_ALLOC_CONF without max_split_size_mb (it is "
            f"{conf!r}): with it torch_npu's out-of-memory retry frees cached blocks of the "
            "sleep pools with aclrtFree, which cannot free virtual-memory mappings."
        )
