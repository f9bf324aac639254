"""What every device provides (:class:`Device`), and the IPC buffer types; no factory here."""

from __future__ import annotations

import hashlib
import socket
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from collections.abc import Callable
    from contextlib import AbstractContextManager

    import torch
    from torch._C._distributed_c10d import Backend as C10dBackend
    from torch.distributed import ProcessGroup, Store


class SleepPool(Protocol):
    """What a device needs of the sleep allocator (``sleep/allocator.py``) to route a block's
    allocations into it; typed here so that ``device`` never imports ``sleep``."""

    device_index: int

    @property
    def allocations(self) -> dict[int, Any]: ...

    def allocate(self, nbytes: int, tag: str) -> Any: ...

    def free(self, addr: int, id_: int = 0) -> None: ...


class IpcHandleError(ValueError):
    """An IPC handle is malformed, points nowhere, or belongs to another chip or host."""


class ImportedBuffer:
    """A trainer's staging buffer mapped into this process."""

    def __init__(self, tensor: torch.Tensor, release: Callable[[], None]) -> None:
        self.tensor: torch.Tensor | None = tensor
        self._release = release

    def open_tensor(self) -> torch.Tensor:
        """The mapped bytes; AssertionError once closed."""
        assert self.tensor is not None, "the buffer was closed"
        return self.tensor

    def close(self) -> None:
        self.tensor = None  # drop our view first: a live view pins the mapping
        self._release()


class ExportedBuffer(ImportedBuffer):
    """A staging buffer the trainer owns and shares; ``handle`` is plain JSON; ``unlink`` makes
    it unreachable for new importers (existing mappings stay valid)."""

    def __init__(
        self,
        tensor: torch.Tensor,
        handle: dict[str, Any],
        unlink: Callable[[], None],
        release: Callable[[], None],
    ) -> None:
        super().__init__(tensor, release)
        self.handle, self.unlink = handle, unlink


def ipc_buffer_id(segment: bytes, offset: int) -> str:
    """An exported buffer's identity: its segment's IPC handle *and* its offset. An NPU IPC
    handle names the allocator's segment, not the block (torch_npu ``shareIpcHandle`` sends the
    offset beside it), and torch_npu keys its cache of opened handles on the pair too
    (``reductions.py:51-53``, 2.10.0.post4)."""
    return hashlib.sha256(segment + b"@" + str(offset).encode()).hexdigest()[:32]


def worker_index(parallel_config: Any) -> int:
    """An engine worker's index among all DP x TP x PP engine workers, numbered as vLLM's
    engines do (nccl_common.py; vllm-ascend hccl_engine.py); on CPU also its emulated chip."""
    return parallel_config.data_parallel_index * parallel_config.world_size + parallel_config.rank


def host_identity() -> dict[str, str]:
    """This host, as two processes on it must agree: hostname and kernel boot id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return {"host": socket.gethostname(), "boot_id": boot}


def check_same_location(theirs: Any, ours: dict[str, str]) -> None:
    if not isinstance(theirs, dict):
        raise IpcHandleError(f"IPC handle has no valid location: {theirs!r}")
    if theirs != ours:
        raise IpcHandleError(
            f"trainer and engine are not on the same chip: trainer on {_where(theirs)}, "
            f"engine on {_where(ours)}. NPU IPC needs them colocated; use the hccl backend "
            "across chips or hosts."
        )


def _where(loc: dict) -> str:
    return f"chip {loc.get('chip', '?')} of host {loc.get('host', '?')}"


class Device(ABC):
    """What the engines need from an accelerator (or from the host standing in for one)."""

    kind: str  # its entry point's name (vllm_ascend_rl.device)
    collective_backend: str  # torch.distributed backend name for weight broadcasts
    vmm_backend: str  # the sleep allocator's virtual-memory back end (vllm_ascend_rl.vmm)
    # Until then a failed collective may still be queued here: no device-wide synchronization.
    hang_until: float = 0.0

    def __init__(self, index: int = 0) -> None:
        # NPU: the logical index, fixed here because the current device is per thread.
        # CPU: an emulated chip (one per engine worker or trainer rank) for IPC colocation.
        self.index = index

    @classmethod
    @abstractmethod
    def current_index(cls) -> int:
        """The index of the calling thread's current device of this kind."""

    @abstractmethod
    def torch_device(self) -> torch.device: ...

    def bind_thread(self) -> None:  # noqa: B027 (only devices with a per-thread current one)
        """Make this device the calling thread's current one (threads start on the default)."""

    def synchronize(self) -> None:  # noqa: B027 (a no-op unless the device queues work)
        """Wait for all work queued on this device by this process, collectives included."""

    def collective_issued(self, work: Any, exec_timeout_s: float) -> None:  # noqa: B027
        """A collective was queued; it stays queued until it completes or ``exec_timeout_s``
        passes. The NPU tracks this itself; the CPU stand-in records it."""

    def empty_cache(self) -> None:  # noqa: B027 (nothing to do unless the device caches)
        """Return memory that the process's allocators cache but no longer use. Device-wide:
        it synchronizes first, so never call it while a collective may hang."""

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A uint8 host buffer the device copies into quickly (pinned on an accelerator)."""
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    @abstractmethod
    def memory_in_use(self) -> int:
        """Bytes of this device's memory in use (on CPU: this process's resident set)."""

    def copy_bytes(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy the flat uint8 tensor ``src`` into ``dst`` (same size), asynchronously where the
        device queues work; :meth:`synchronize` waits for it."""
        dst.copy_(src, non_blocking=True)

    @abstractmethod
    def read_device(self, addr: int, out: torch.Tensor) -> None:
        """Copy ``out.numel()`` bytes at device address ``addr`` into the host tensor ``out``."""

    @abstractmethod
    def write_device(self, addr: int, src: torch.Tensor) -> None:
        """Copy the host tensor ``src`` to device address ``addr``."""

    @abstractmethod
    def memory_pool(self, allocator: SleepPool, tag: str) -> AbstractContextManager[None]:
        """A block in which this thread's new tensors on this device come from ``allocator``
        (``allocator.use_memory_pool`` has set ``tag`` for the native entry points)."""

    def location(self) -> dict[str, str]:
        """Where this device is: host identity plus the physical chip."""
        return {**host_identity(), "chip": f"{self.kind}{self.index}"}

    @abstractmethod
    def create_ipc_buffer(self, nbytes: int) -> ExportedBuffer:
        """A uint8 staging buffer another process on the same chip can map."""

    @abstractmethod
    def open_ipc_buffer(self, handle: dict[str, Any]) -> ImportedBuffer:
        """Map a buffer exported by :meth:`create_ipc_buffer`; IpcHandleError if impossible."""

    def weight_update_refusal(self) -> str | None:
        """Why the serving stack would refuse every weight update on this device, with the
        setting that fixes it; None if it will not."""
        return None

    # -- the weight-broadcast group (see vllm_ascend_rl.device.group) ----------------------
    @abstractmethod
    def group_backend(
        self, store: Store, rank: int, world_size: int, timeout_s: float, group_id: str
    ) -> C10dBackend:
        """Our weight-broadcast group's backend over ``store``, for :attr:`collective_backend`
        on ``torch.device(kind)``; ``group_id`` names the rendezvous, the same on every rank."""

    def close_group(self, pg: ProcessGroup, broken: bool) -> None:
        """Release the group. ``broken``: a collective failed or timed out and may still be
        queued, so tear down without waiting for it."""
        pg.shutdown()
