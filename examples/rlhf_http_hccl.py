"""Async RL with vLLM and the HCCL weight-transfer engine: generate with weights k while the
trainer produces k+1; pause(keep); sync; resume; validate.

The engine is a vLLM server started with ``--weight-transfer-config '{"backend":
"ascend_rl_hccl"}'`` and the plugin scheduler; this script is the trainer. Each step streams
requests on weights k while a training step (here: loading checkpoint k+1) runs in a thread.
Once every request has a few tokens the server is paused with ``mode=keep`` (requests stay;
their KV cache, stale after the update, is dropped), the weights are broadcast, and the server
resumes: every request recomputes its context and continues on the new weights. A reference
server on k+1 must then reproduce each continuation exactly, greedily, from prompt + the tokens
generated before the pause. One row per step. A training step that fails ends the run with its
error before anything is sent. Against your own servers a step is validated only with a
reference (``--reference-url``) on the weights it trains to (``--train-checkpoints``); otherwise
the steps run and are reported as not validated.

    python examples/rlhf_http_hccl.py          # CPU: tiny checkpoints, servers built here
    python examples/rlhf_http_hccl.py --server-url http://engine:8000 --model /path/to/hf \\
        --device npu --master-address <this host's IP>

    # your servers, validated: the engine on V1, the reference on V2; the steps load V2, V3
    python examples/rlhf_http_hccl.py --server-url http://engine:8000 --model V1 \\
        --reference-url http://reference:8000 --train-checkpoints V2 V3

(Set-up that is not the point, the tiny checkpoints and the servers, is in plumbing/rl_demo.py.)
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from vllm.distributed.weight_transfer import (
    HTTPVLLMWeightSyncClient,
    ModuleSource,
    WeightTransferTrainerFactory,
)
from vllm.utils.network_utils import get_open_port

import vllm_ascend_rl
from vllm_ascend_rl.client import EngineControlClient
from vllm_ascend_rl.weight_transfer.hccl import HCCLTrainerInitInfo

if __package__:  # imported from the repository root: examples.rlhf_http_hccl
    from .plumbing import rl_demo
else:  # run as a script: python examples/rlhf_http_hccl.py
    from plumbing import rl_demo


def main() -> int:
    args = rl_demo.parse_args(__doc__.split("\n\n")[0])
    vllm_ascend_rl.register()  # a trainer is not a vLLM process: register by hand
    with rl_demo.demo(args, "ascend_rl_hccl") as setup:
        # -- set-up: the control client and the trainer's side of the weight transfer ----
        ctl = EngineControlClient(setup.engine_url)
        workers = ctl.world_size()  # every engine worker (TP x PP x DP) joins the group
        trainer = WeightTransferTrainerFactory.trainer_init(
            HCCLTrainerInitInfo(
                master_address=args.master_address,  # the trainer hosts the rendezvous
                master_port=get_open_port(),
                world_size=workers + 1,
                rank=0,
                packed=True,
            ),
            client=HTTPVLLMWeightSyncClient(setup.engine_url),
            source=ModuleSource(setup.policy.model),
        )
        rl_demo.print_header("pause ms")
        all_ok, validated = True, 0
        training_thread = ThreadPoolExecutor(1, thread_name_prefix="training")
        for k in range(1, args.steps + 1):
            # -- generate with weights k while the trainer produces k+1 -------------------
            training = training_thread.submit(setup.policy.train_step, k)
            streams = rl_demo.start_streams(setup.engine_url, args.max_tokens, args.model_name)
            rl_demo.wait_for_tokens(streams, args.min_tokens)
            try:
                training.result()  # k+1, or the step's error: never sync weights k again
            except Exception as e:
                raise RuntimeError(f"training step v{k}->v{k + 1} failed; nothing sent") from e

            # -- pause (keep) -> sync -> resume --------------------------------------------
            t0 = time.perf_counter()
            ctl.pause("keep")
            pause_ms = (time.perf_counter() - t0) * 1e3
            split = rl_demo.settled_counts(streams)  # tokens each request had on weights k
            result = trainer.send_weights(weight_version=f"v{k + 1}")
            resumed_at = [s.num_tokens for s in streams]  # nothing generated while paused
            ctl.resume()
            for s in streams:
                s.join(600)

            # -- validate: each continuation, from its own prefix, on a fresh v(k+1) -------
            reference = setup.reference_for(k)
            matches = (
                None
                if reference is None
                else [
                    rl_demo.continuation_matches(reference, s, n, args.model_name)
                    for s, n in zip(streams, split, strict=True)
                ]
            )
            all_ok &= rl_demo.report(
                k, streams, split, resumed_at, pause_ms, result, matches, args.max_tokens
            )
            validated += matches is not None
        trainer.shutdown()
        training_thread.shutdown()
    return rl_demo.conclude(all_ok, validated, args.steps)


if __name__ == "__main__":
    raise SystemExit(main())
