"""The trainer-to-engine process group, built by us the same way on every device.

Not vLLM's ``stateless_init_torch_distributed_process_group``: it hands non-gloo backends to
``current_platform.stateless_init_device_torch_dist_pg``, which vllm-ascend does not implement
(removed in cea0755b07), and has no ``timeout`` in vLLM 0.27.1. Built as vllm-ascend's
netloader builds its HCCL group (``vllm_ascend/model_loader/netloader/executor/netloader_pg.py``);
only :meth:`Device.group_backend` differs between CPU and NPU. Not in ``torch.distributed``'s
global tables: callers use ``pg.broadcast``/``pg.allreduce`` directly (as vLLM's stateless
groups)."""

from __future__ import annotations

import ipaddress
import math
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, Store

    from vllm_ascend_rl.device.base import Device

GROUP_NAME = "vllm_ascend_rl_weights"


def exec_timeout_s(timeout_s: float) -> int:
    """How long (``timeout_s`` rounded up to whole seconds) a collective of our group may stay
    queued on the device. On NPU it is the communicator's ``hccl_exec_timeout``, so a broadcast
    hung on a dead trainer leaves the HCCL stream near our deadline, not after
    HCCL_EXEC_TIMEOUT (1836 s); until then every device-wide synchronize waits behind it."""
    return max(1, math.ceil(timeout_s))


def tcp_uri(host: str, port: int) -> str:
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        return f"tcp://{host}:{port}"
    return f"tcp://[{host}]:{port}"


def open_group(
    device: Device, host: str, port: int, rank: int, world_size: int, timeout_s: float
) -> tuple[ProcessGroup, Store]:
    """Rendezvous at ``host:port`` (rank 0 hosts the store) and form the group; every step
    gives up after ``timeout_s``. Returns the group and its store (keys under the group's
    prefix)."""
    from torch.distributed import PrefixStore, ProcessGroup
    from torch.distributed.rendezvous import rendezvous

    timeout = timedelta(seconds=timeout_s)
    uri = tcp_uri(host, port)
    store, rank, world_size = next(rendezvous(uri, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    prefix = PrefixStore(group_prefix(host, port), store)
    group_id = group_prefix(host, port)
    pg = ProcessGroup(prefix, rank, world_size)
    backend = device.group_backend(prefix, rank, world_size, timeout_s, group_id)
    pg._set_default_backend(backend.default_type)
    backend.impl._set_sequence_number_for_group()
    pg._register_backend(backend.torch_device, backend.register_type, backend.impl)
    return pg, prefix


def group_prefix(host: str, port: int) -> str:
    """The group's name, the same on every rank: its store keys live under it."""
    return f"{tcp_uri(host, port)}/{GROUP_NAME}/"
