"""The trainer-to-engine process group, built by us the same way on every device.

vLLM's ``stateless_init_torch_distributed_process_group`` hands every non-gloo backend to
``current_platform.stateless_init_device_torch_dist_pg``, which vllm-ascend no longer
implements (vllm-ascend cea0755b07), and its ``timeout`` argument does not exist in vLLM 0.27.1.
So the group is assembled here, as vllm-ascend's netloader assembles its HCCL group
(``vllm_ascend/model_loader/netloader/executor/netloader_pg.py``): a TCP rendezvous hosted by
rank 0 with our timeout, a ``PrefixStore`` of our own, a ``ProcessGroup`` and the device's
backend (:meth:`Device.group_backend`: gloo on CPU, ``ProcessGroupHCCL`` with explicit options
on NPU). Only that backend differs, so CI runs everything here but the HCCL calls.

The group is not entered in ``torch.distributed``'s global tables: callers use its methods
(``pg.broadcast``/``pg.allreduce``) directly, as with vLLM's stateless groups.
"""

from __future__ import annotations

import ipaddress
import math
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from vllm_ascend_rl.device import Device

GROUP_NAME = "vllm_ascend_rl_weights"


def exec_timeout_s(timeout_s: float) -> int:
    """How long a collective of our group may stay queued on the device, in whole seconds:
    ``timeout_s`` rounded up. On NPU this is the communicator's own HCCL exec timeout
    (``hccl_config["hccl_exec_timeout"]``), so a broadcast hung on a dead trainer leaves the
    HCCL stream about when our deadline gives up on it, instead of after HCCL_EXEC_TIMEOUT
    (1836 s by default); until then every device-wide synchronize waits behind it."""
    return max(1, math.ceil(timeout_s))


def tcp_uri(host: str, port: int) -> str:
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        return f"tcp://{host}:{port}"
    return f"tcp://[{host}]:{port}"


def open_group(
    device: Device, host: str, port: int, rank: int, world_size: int, timeout_s: float
) -> ProcessGroup:
    """Rendezvous at ``host:port`` (rank 0 hosts the store) and form the group; every step
    gives up after ``timeout_s``."""
    from torch.distributed import PrefixStore, ProcessGroup
    from torch.distributed.rendezvous import rendezvous

    timeout = timedelta(seconds=timeout_s)
    uri = tcp_uri(host, port)
    store, rank, world_size = next(rendezvous(uri, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    group_id = f"{uri}/{GROUP_NAME}/"
    prefix = PrefixStore(group_id, store)
    pg = ProcessGroup(prefix, rank, world_size)
    backend = device.group_backend(prefix, rank, world_size, timeout_s, group_id)
    pg._set_default_backend(backend.default_type)
    backend.impl._set_sequence_number_for_group()
    pg._register_backend(backend.torch_device, backend.register_type, backend.impl)
    return pg
