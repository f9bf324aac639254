"""Async RL with vLLM and the HCCL weight-transfer engine: generate with weights k while the
trainer produces k+1; pause(keep); sync; resume; validate.

With no arguments, on CPU: builds tiny random-weight checkpoints v1..v4, starts a vLLM server on
v1 with ``--weight-transfer-config '{"backend": "ascend_rl_hccl"}'`` and the plugin scheduler,
plus a reference server used only for validation. This script is the trainer. Each step streams
requests on weights k while a "training step" (loading checkpoint k+1) runs in a thread; once
every request has some tokens the server is paused with ``mode=keep``, the weights are sent,
and the server resumes. In-flight requests then recompute their context and continue on the
new weights; the reference server on checkpoint k+1 must reproduce every continuation exactly
from prompt + tokens-before-pause. One table row per step.

Real use (e.g. on Ascend, against a server you started with the flags above)::

    python examples/rlhf_http_hccl.py --server-url http://engine:8000 --model /path/to/hf \\
        --device npu --master-address <this host's IP> [--reference-url http://ref:8000]
"""

from __future__ import annotations

import sys

from vllm.distributed.weight_transfer import (
    HTTPVLLMWeightSyncClient,
    ModuleSource,
    WeightTransferTrainerFactory,
)

from vllm_ascend_rl.client import EngineControlClient
from vllm_ascend_rl.testing import free_port
from vllm_ascend_rl.testing.rl_loop import demo_args, demo_main
from vllm_ascend_rl.weight_transfer.hccl import HCCLTrainerInitInfo


def connect(url: str, model, args):
    """The whole trainer-side setup: public calls only (register() ran before)."""
    workers = EngineControlClient(url).world_size()  # engine workers across TP*PP*DP
    return WeightTransferTrainerFactory.trainer_init(
        HCCLTrainerInitInfo(
            master_address=args.master_address,
            master_port=free_port(),
            world_size=workers + 1,
            rank=0,
            packed=True,
        ),
        client=HTTPVLLMWeightSyncClient(url),
        source=ModuleSource(model),
    )


if __name__ == "__main__":
    sys.exit(demo_main(demo_args(__doc__.split("\n\n")[0]), "ascend_rl_hccl", connect))
