"""The trainer-to-engine process group, built by us the same way on every device.

Not vLLM's ``stateless_init_torch_distributed_process_group``: it hands non-gloo backends to
``current_platform.stateless_init_device_torch_dist_pg``, which vllm-ascend does not implement
(removed in cea0755b07). Built as vllm-ascend's
netloader builds its HCCL group (``vllm_ascend/model_loader/netloader/executor/netloader_pg.py``);
only :meth:`Device.group_backend` differs between CPU and NPU. Not in ``torch.distributed``'s
global tables: callers use ``pg.broadcast``/``pg.allreduce`` directly (as vLLM's stateless
groups)."""

from __future__ import annotations

import ipaddress
import math
import re
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, Store

    from vllm_ascend_rl.device.base import Device

GROUP_NAME = "vllm_ascend_rl_weights"


# vllm-ascend's HCCL buffer for its own groups, in MB (_DEFAULT_BUFFER_SIZE, utils.py:70).
HCCL_BUFFER_MB = 200
# How long HCCL holds a collective when the communicator sets no exec timeout: torch_npu 2.10
# assumes HCCL_EXEC_TIMEOUT's default (ProcessGroupHCCL.cpp:77, 1194-1197).
HCCL_DEFAULT_EXEC_TIMEOUT_S = 1836


def hccl_config(timeout_s: float, group_id: str) -> dict[str, int | str]:
    """Our group's HCCL communicator settings (``ProcessGroupHCCL.Options.hccl_config``, read in
    ``createHcclCommConfigWithOptions``, ProcessGroupHCCL.cpp:3907-4076, torch_npu 2.10.0.post4):

    - ``hccl_exec_timeout``: whole seconds (an int32, ``:3998-4013``) a collective may stay
      queued on the device: ``timeout_s`` rounded up, so one hung on a dead trainer leaves the
      HCCL stream, and every device-wide wait behind it, about when we give up on it;
    - ``hccl_buffer_size``: MB, as vllm-ascend sizes its groups' (utils.py:960-991);
    - ``group_name``: the rendezvous in plain characters, HCCL's user-defined info for its logs
      (hcclUdi, ``:3935-3948``).

    The CPU stand-in holds a failed collective queued for the same exec timeout
    (:func:`exec_timeout_of`)."""
    return {
        "hccl_buffer_size": HCCL_BUFFER_MB,
        "group_name": re.sub(r"[^A-Za-z0-9_]+", "_", group_id).strip("_"),
        "hccl_exec_timeout": max(1, math.ceil(timeout_s)),
    }


def exec_timeout_of(config: dict[str, int | str]) -> int:
    """How long a collective of a group built with ``config`` may stay queued on the device."""
    return int(config.get("hccl_exec_timeout", HCCL_DEFAULT_EXEC_TIMEOUT_S))


def tcp_uri(host: str, port: int) -> str:
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        return f"tcp://{host}:{port}"
    return f"tcp://[{host}]:{port}"


def open_group(
    device: Device,
    host: str,
    port: int,
    rank: int,
    world_size: int,
    timeout_s: float,
    within_s: float,
) -> tuple[ProcessGroup, Store, dict[str, int | str]]:
    """Rendezvous at ``host:port`` (rank 0 hosts the store) within ``within_s`` and form the
    group, whose collectives and store calls are bounded by ``timeout_s``. Returns the group,
    its store (keys under the group's prefix) and its :func:`hccl_config`."""
    import torch
    from torch.distributed import PrefixStore, ProcessGroup
    from torch.distributed.distributed_c10d import Backend
    from torch.distributed.rendezvous import rendezvous

    uri = tcp_uri(host, port)
    rendezvous_timeout = timedelta(seconds=within_s)
    store, rank, world_size = next(rendezvous(uri, rank, world_size, timeout=rendezvous_timeout))
    store.set_timeout(timedelta(seconds=timeout_s))
    group_id = f"{uri}/{GROUP_NAME}/"  # the same on every rank; the store's keys live under it
    prefix = PrefixStore(group_id, store)
    pg = ProcessGroup(prefix, rank, world_size)
    backend = device.group_backend(prefix, rank, world_size, timeout_s, group_id)
    # Default and registered type alike: GLOO for gloo; CUSTOM for hccl, as register_backend
    # maps every plugin backend (torch_npu/_init/registry/distributed.py:34-44, 2.10.0.post4).
    backend_type = Backend.backend_type_map[Backend(device.collective_backend)]
    pg._set_default_backend(backend_type)
    backend._set_sequence_number_for_group()
    pg._register_backend(torch.device(device.kind), backend_type, backend)
    return pg, prefix, hccl_config(timeout_s, group_id)
