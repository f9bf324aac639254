"""CaMemAllocator: tagged allocations that sleep and wake at the same virtual addresses
(docs/sleep-mode.md), over the device's back end (``vllm_ascend_rl.vmm``): ``acl`` (CANN virtual
memory, fed by torch_npu's pluggable allocator), or the CPU stand-in's ``host``.

Every allocation's state lives only in the native table (``vmm.table_*``, vmm_table.h),
which the entry points use without Python (they run under torch_npu's allocator lock, where
taking the GIL could deadlock), so a free through them always sees the current state. Only the
host backups live here."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_ascend_rl import vmm as vmm_lib
from vllm_ascend_rl.device import Device, device_kind, get_device
from vllm_ascend_rl.logs import get_logger

logger = get_logger(__name__)

DEFAULT_TAG = "default"
PERSISTENT_TAG = "sleep_persistent"  # never released by sleep or discard


class SleepError(RuntimeError):
    """A sleep, wake or allocation failed; the allocator is left in a consistent state."""


@dataclass(frozen=True)
class Allocation:
    """One allocation-table entry as read at one moment, with its host backup; a snapshot."""

    addr: int
    size: int  # bytes, a multiple of the back end's granularity
    tag: str
    device: int
    handle: int | None  # physical memory; None while asleep
    mapped: bool  # awake: physical memory is mapped at addr
    id: int  # unique in the process; an address can be reused after a free, an id cannot
    backup: torch.Tensor | None = field(default=None, compare=False)  # host copy, reused
    has_backup: bool = False  # the backup holds this allocation's contents right now


@dataclass
class _Backup:
    """The host copy of the table entry ``id``."""

    id: int
    tensor: torch.Tensor
    current: bool = False  # holds the entry's contents right now


class CaMemAllocator:
    """Sleep and wake over the process's one allocation table: use ``get_instance`` (another
    instance of the same back end sees the same entries). Every method is thread-safe."""

    _instance: CaMemAllocator | None = None
    _instance_lock = threading.Lock()

    @classmethod
    def get_instance(cls, backend: str | None = None, device: int | None = None) -> CaMemAllocator:
        """The process's allocator. The first call must name the device (known to a worker
        only after ``init_device``); naming another back end or device later raises
        SleepError: one worker process serves one device."""
        with cls._instance_lock:
            if cls._instance is None:
                if device is None:
                    raise SleepError(
                        "the sleep allocator is created by the worker once its device is known "
                        "(after init_device); nothing created it yet"
                    )
                cls._instance = cls(backend, device=device)
            inst = cls._instance
            if (device is not None and device != inst.device_index) or (
                backend is not None and backend != inst.backend
            ):
                raise SleepError(
                    f"this process's sleep allocator serves {inst.backend} device "
                    f"{inst.device_index}; asked for {backend or inst.backend} device "
                    f"{inst.device_index if device is None else device}"
                )
            return inst

    def __init__(
        self,
        backend: str | None = None,
        vmm: Any = None,
        device: int = 0,
        keep_backups: bool | None = None,
    ) -> None:
        self.vmm = vmm or vmm_lib
        self.device_index = device
        hw = self.device
        backend = backend or hw.vmm_backend  # loading the device adds its back end
        if backend not in self.vmm.backends():
            raise SleepError(
                f"VMM back end {backend!r} is not available (built: {self.vmm.backends()})"
            )
        if backend == "acl":
            check_npu_alloc_conf()
        self.backend = backend
        self.maps_zeroed = bool(self.vmm.maps_zeroed(backend))
        # Off: a colocated trainer gets the backups' host memory back after every wake.
        if keep_backups is None:
            keep_backups = os.environ.get("VLLM_ASCEND_RL_SLEEP_KEEP_BACKUPS", "1") != "0"
        self.keep_backups = keep_backups
        self._backups: dict[int, _Backup] = {}  # by address
        self._lock = threading.RLock()

    @property
    def device(self) -> Device:
        """The device whose memory this allocator maps."""
        return self._hw(self.device_index)

    def _hw(self, index: int) -> Device:
        return get_device(device_kind(), index)

    # -- allocation ------------------------------------------------------------------
    @property
    def allocations(self) -> dict[int, Allocation]:
        """The table's entries of this back end by address, as read now."""
        return {a.addr: a for a in self._entries()}

    def allocate(self, nbytes: int, tag: str = DEFAULT_TAG, populate: bool = True) -> Allocation:
        """Reserve, back and map ``nbytes`` (rounded up to the granularity) tagged ``tag``; all
        or nothing. ``populate`` commits it now, so a shortage raises here."""
        args = (self.backend, max(nbytes, 1), tag, self.device_index, populate)
        with self._lock:
            return self._snapshot(*self._call("table_allocate", *args))

    def free(self, addr: int, id_: int = 0) -> None:
        """Release the allocation at ``addr`` (if ``id_``, only that entry) whatever its state;
        KeyError if none. A failure leaves it recorded in the state it reached, not leaked. The
        caller drains the device."""
        with self._lock:
            if not self._call("table_free", addr, id_):
                raise KeyError(addr)
            self._backups.pop(addr, None)

    @contextmanager
    def use_memory_pool(self, tag: str = DEFAULT_TAG) -> Iterator[None]:
        """Every tensor allocated inside is tagged ``tag`` (:meth:`Device.memory_pool`: on Ascend
        torch_npu's pluggable pool; on CPU ``torch.zeros``/``torch.empty`` from host memory)."""
        previous = self.vmm.table_set_tag(tag)
        try:
            with self.device.memory_pool(self, tag):
                yield
        finally:
            self.vmm.table_set_tag(previous)

    def outside(self, tag: str, tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """The ones of ``tensors`` that no allocation of ``tag`` backs."""
        spans = [(a.addr, a.addr + a.size) for a in self._entries() if a.tag == tag]
        ptrs = [(t, t.untyped_storage().data_ptr()) for t in tensors]
        return [t for t, p in ptrs if not any(lo <= p < hi for lo, hi in spans)]

    def keep_only(self, tag: str, tensors: Iterable[torch.Tensor]) -> int:
        """Re-tag ``sleep_persistent`` every allocation of ``tag`` that backs none of
        ``tensors``; return how many. A pool around a whole initialization step also catches
        bookkeeping buffers, which must not be released with the KV cache."""
        starts = [t.untyped_storage().data_ptr() for t in tensors if t.numel()]
        moved = 0
        with self._lock:
            for alloc in self._entries():
                if alloc.tag == tag and not any(
                    alloc.addr <= p < alloc.addr + alloc.size for p in starts
                ):
                    moved += self.vmm.table_retag(alloc.addr, alloc.id, PERSISTENT_TAG)
        if moved:
            logger.info("%d %s allocation(s) hold no KV cache: kept across sleep", moved, tag)
        return moved

    # -- sleep / wake ----------------------------------------------------------------
    def sleep(self, offload_tags: Iterable[str] | str | None = None) -> None:
        """Back up ``offload_tags`` to host memory, then release the physical memory of every
        awake allocation but ``sleep_persistent`` (addresses stay reserved), the device drained
        first. All or nothing (:meth:`_release`). Nothing may free them through the entry
        points meanwhile (torch_npu frees a pool's segments only once the pool is gone;
        device/npu.py keeps every pool)."""
        offload = _tags(offload_tags) or set()
        with self._lock:
            victims = [a for a in self._entries() if a.mapped and a.tag != PERSISTENT_TAG]
            self._release(victims, offload, f"sleep (offloading {sorted(offload) or 'nothing'})")

    def wake_up(self, tags: Iterable[str] | str | None = None) -> None:
        """Map fresh, populated memory at the same addresses for ``tags`` (all if None) and
        restore backups (else zeros); awake allocations are left alone. Any failure releases
        what this call mapped and raises SleepError: cleanly asleep again, backups intact."""
        wanted = _tags(tags)
        with self._lock:
            woken: list[Allocation] = []
            try:
                for alloc in self._entries():
                    if alloc.mapped or (wanted is not None and alloc.tag not in wanted):
                        continue
                    # Populated: a shortage fails (and rolls back) this wake, not a later page
                    # fault, and the first forward pass pays no faults (ACL maps eagerly).
                    if self._call("table_wake", alloc.addr, alloc.id, True):
                        woken.append(alloc)
                        self._restore(alloc)
            except Exception as e:
                for alloc in woken:
                    self._quietly("rolling back a failed wake", "table_sleep", alloc)
                raise SleepError(
                    f"wake_up({sorted(wanted) if wanted else 'all'}) failed and was rolled "
                    f"back: {type(e).__name__}: {e}"
                ) from e
            for alloc in woken:  # the backups are outdated, and dropped unless keep_backups
                if self.keep_backups:
                    self._outdate_backup(alloc.addr)
                else:
                    self._backups.pop(alloc.addr, None)

    def discard(self, tags: Iterable[str] | str) -> None:
        """Release ``tags`` without keeping their contents; they wake zero-filled. A backup of
        one already asleep is dropped too, or it would wake with pre-discard contents. All or
        nothing, as :meth:`sleep`."""
        wanted = _tags(tags) or set()
        with self._lock:
            chosen = [a for a in self._entries() if a.tag in wanted and a.tag != PERSISTENT_TAG]
            self._release([a for a in chosen if a.mapped], set(), f"discard({sorted(wanted)})")
            for alloc in chosen:
                if not alloc.mapped and alloc.has_backup:
                    logger.warning(
                        "discard(%s): dropping the sleep backup of 0x%x", alloc.tag, alloc.addr
                    )
                    self._backups.pop(alloc.addr, None)

    def get_current_usage(self) -> int:
        """Bytes of physical memory currently held."""
        return sum(a.size for a in self._entries() if a.mapped)

    def is_awake(self, tag: str) -> bool:
        return all(a.mapped for a in self._entries() if a.tag == tag)

    def tags(self) -> set[str]:
        return {a.tag for a in self._entries()}

    # -- helpers ---------------------------------------------------------------------
    def _entries(self) -> list[Allocation]:
        """This back end's entries with their backups (dropping those of entries now gone)."""
        with self._lock:
            rows = self.vmm.table_entries(self.backend)
            live = {row[0]: row[6] for row in rows}
            self._backups = {a: b for a, b in self._backups.items() if live.get(a) == b.id}
            return [self._snapshot(*row) for row in rows]

    def _snapshot(
        self, addr: int, size: int, device: int, handle: int, mapped: bool, tag: str, id_: int
    ) -> Allocation:
        """An Allocation from a table row (``vmm.table_entries``)."""
        backup = self._backups.get(addr)
        backup = backup if backup is not None and backup.id == id_ else None
        return Allocation(
            addr, size, tag, device, handle or None, mapped, id_,
            backup.tensor if backup else None, bool(backup and backup.current),
        )  # fmt: skip

    def _back_up(self, alloc: Allocation) -> None:
        """Copy an awake allocation to its host backup, allocated on its first sleep."""
        hw = self._hw(alloc.device)
        backup = self._backups.get(alloc.addr)
        if backup is None or backup.id != alloc.id:
            backup = self._backups[alloc.addr] = _Backup(alloc.id, hw.host_buffer(alloc.size))
        hw.read_device(alloc.addr, backup.tensor)
        backup.current = True

    def _outdate_backup(self, addr: int) -> None:
        """The allocation's contents are no longer in its backup (the tensor is kept)."""
        if (backup := self._backups.get(addr)) is not None:
            backup.current = False

    def _restore(self, alloc: Allocation) -> None:
        """Fill a just-woken allocation: its backup if current, else zeros."""
        if alloc.has_backup and alloc.backup is not None:
            self._hw(alloc.device).write_device(alloc.addr, alloc.backup)
        elif not self.maps_zeroed:
            self._call("zero", self.backend, alloc.addr, alloc.size, alloc.device)

    def _release(self, victims: list[Allocation], offload: set[str], what: str) -> None:
        """Drain the device (queued work could write after the backup or touch unmapped
        memory), then release the victims' physical memory, those tagged in ``offload`` backed
        up first. All or nothing: every backup is taken and every victim unmapped with its
        physical memory kept before any is freed; a failure at any of them maps back what was
        unmapped (the same memory, contents as they were) and raises SleepError: still awake.
        vLLM marks the executor asleep only if the call returns (``executor/abstract.py``,
        sleep), so a half-done sleep would let ``/wake_up`` resume generation on unmapped
        memory. A free that fails after that is logged, never raised: asleep either way."""
        for index in sorted({a.device for a in victims}):
            self._hw(index).synchronize()
        kept = [a for a in victims if a.tag in offload]
        backed_up: list[Allocation] = []
        unmapped: list[Allocation] = []
        try:
            for alloc in kept:
                self._back_up(alloc)
                backed_up.append(alloc)
            for alloc in victims:
                self._call("table_unmap", alloc.addr, alloc.id)
                unmapped.append(alloc)
        except Exception as e:
            if len(backed_up) < len(kept):
                step, at, steps = "backing up", len(backed_up), len(kept)
            else:
                step, at, steps = "unmapping", len(unmapped), len(victims)
            back = "rolling back a failed sleep: stays unmapped"
            lost = [a for a in unmapped if not self._quietly(back, "table_wake", a, False)]
            for alloc in kept:
                self._outdate_backup(alloc.addr)
            state = "every allocation is mapped as it was"
            if lost:
                state = f"{len(lost)} allocation(s) could not be mapped back (see the log)"
            raise SleepError(
                f"{what} failed {step} allocation {at + 1} of {steps} and was rolled back: "
                f"{state} ({type(e).__name__}: {e})"
            ) from e
        for alloc in victims:
            if alloc.tag not in offload:
                self._outdate_backup(alloc.addr)
            # Unmapped, its handle forgotten if this fails: asleep either way, memory leaked.
            self._quietly(f"{what}: asleep, its memory not freed", "table_sleep", alloc)

    def _quietly(self, what: str, op: str, alloc: Allocation, *args: Any) -> bool:
        """``op`` on ``alloc``'s entry; a SleepError is logged as ``what`` and gives False: the
        caller's outcome stands (a rollback reports the original failure)."""
        try:
            self._call(op, alloc.addr, alloc.id, *args)
        except SleepError as e:
            logger.error("%s at 0x%x: %s", what, alloc.addr, e)
            return False
        return True

    def _call(self, op: str, *args: Any) -> Any:
        """``self.vmm.op(*args)``, a VmmError raised as SleepError naming the failed call."""
        try:
            return getattr(self.vmm, op)(*args)
        except self.vmm.VmmError as e:
            code, message = e.args
            step = e.op.partition(".")[2] or op
            raise SleepError(f"{self.backend} VMM {step} failed (code {code}): {message}") from e


def _tags(tags: Iterable[str] | str | None) -> set[str] | None:
    if tags is None:
        return None
    return {tags} if isinstance(tags, str) else set(tags)


def check_npu_alloc_conf(conf: str | None = None) -> None:
    """Refuse torch_npu allocator settings (``conf``, default this process's
    ``PYTORCH_NPU_ALLOC_CONF``) under which it maps or frees pool memory behind our back:
    expandable segments (its expandable branch runs before the pool branch,
    NPUCachingAllocator.cpp:2707-2724 in torch_npu 2.10.0.post4) and ``max_split_size_mb``
    (its OOM retry, ``release_available_cached_blocks`` ``:2764``, releases cached blocks of
    the current pool with a plain ``aclrtFree`` in ``release_block``, ``:2858-2897``)."""
    if conf is None:
        conf = os.environ.get("PYTORCH_NPU_ALLOC_CONF", "")
    conf = conf.replace(" ", "").lower()
    if "expandable_segments:true" in conf:
        raise SleepError(
            "sleep mode needs PYTORCH_NPU_ALLOC_CONF without expandable_segments:True "
            f"(it is {conf!r}): expandable segments map memory outside the sleep allocator, "
            "which then cannot release it. Set expandable_segments:False (unset, vllm-ascend turns "
            "them on)."
        )
    if "max_split_size_mb" in conf:
        raise SleepError(
            f"sleep mode needs PYTORCH_NPU_ALLOC_CONF without max_split_size_mb (it is "
            f"{conf!r}): with it torch_npu's out-of-memory retry frees cached blocks of the "
            "sleep pools with aclrtFree, which cannot free virtual-memory mappings."
        )
