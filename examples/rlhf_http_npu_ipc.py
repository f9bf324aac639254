"""Colocated RL with vLLM and the NPU-IPC weight-transfer engine: trainer and engine share a
chip, so weights are handed over through shared staging buffers instead of a collective.

With no arguments, on CPU (shared memory stands in for NPU IPC): builds tiny checkpoints v1..v4,
starts a vLLM server on v1 with ``--weight-transfer-config '{"backend": "ascend_rl_npu_ipc"}'``,
the plugin scheduler and the sleepable CPU worker, plus a reference server used only for
validation. Each step streams requests on weights k, then ``/sleep?level=2&mode=keep`` (the
engine gives its KV cache and weights back while the trainer trains: it loads checkpoint k+1),
wakes the weights, syncs them, wakes the KV cache (which resumes); the reference on k+1 must
reproduce every continuation exactly from prompt + tokens-before-pause. One row per step.

Real use (on Ascend, a server on the same chip started with
``--worker-cls vllm_ascend_rl.worker.npu_worker.SleepableNPUWorker``)::

    python examples/rlhf_http_npu_ipc.py --server-url http://localhost:8000 \\
        --model /path/to/hf --device npu
"""

from __future__ import annotations

import sys

from vllm.distributed.weight_transfer import (
    HTTPVLLMWeightSyncClient,
    ModuleSource,
    WeightTransferTrainerFactory,
)

from vllm_ascend_rl.testing.rl_loop import demo_args, demo_main
from vllm_ascend_rl.weight_transfer.npu_ipc import NPUIPCTrainerInitInfo

SLEEPABLE_CPU_WORKER = "vllm_ascend_rl.worker.cpu_worker.SleepableCPUWorker"


def connect(url: str, model, args):
    """The whole trainer-side setup: public calls only (register() ran before)."""
    return WeightTransferTrainerFactory.trainer_init(
        NPUIPCTrainerInitInfo(rank=0, packed=True),
        client=HTTPVLLMWeightSyncClient(url),
        source=ModuleSource(model),
    )


if __name__ == "__main__":
    sys.exit(
        demo_main(
            demo_args(__doc__.split("\n\n")[0]),
            "ascend_rl_npu_ipc",
            connect,
            engine_flags=["--worker-cls", SLEEPABLE_CPU_WORKER],
            colocated=True,
            sleep_level=2,
        )
    )
