"""Colocated RL with vLLM and the NPU-IPC weight-transfer engine: trainer and engine share a
chip, so weights are handed over through shared staging buffers instead of a collective, and
the engine sleeps while the trainer trains.

The engine is a vLLM server on the trainer's chip, started with ``--weight-transfer-config
'{"backend": "ascend_rl_npu_ipc"}'``, the plugin scheduler and the device's sleepable worker
(``--worker-cls vllm_ascend_rl.worker.npu_worker.SleepableNPUWorker``; on CPU, where shared
memory stands in for NPU IPC, ``...cpu.worker.SleepableCPUWorker``). Each step streams requests
on weights k; once each has a few tokens, ``/sleep?level=2&mode=keep`` pauses them and gives
the KV cache and the weights back; the trainer trains (here: loads checkpoint k+1); the engine
wakes its weights, the trainer syncs them, the engine wakes its KV cache, and ``/resume`` lets
every request continue on the new weights. A reference server on k+1 must reproduce each
continuation exactly from prompt + the tokens before the pause. One row per step. A training
step that fails ends the run with its error (the engine stays asleep). Against your own servers
a step is validated only with a reference (``--reference-url``) on the weights it trains to
(``--train-checkpoints``); otherwise the steps run and are reported as not validated.

    python examples/rlhf_http_npu_ipc.py       # CPU: tiny checkpoints, servers built here
    python examples/rlhf_http_npu_ipc.py --server-url http://localhost:8000 \\
        --model /path/to/hf --device npu

    # your servers, validated: the engine on V1, the reference on V2; the steps load V2, V3
    python examples/rlhf_http_npu_ipc.py --server-url http://localhost:8000 --model V1 \\
        --reference-url http://localhost:8001 --train-checkpoints V2 V3

(Set-up that is not the point, the tiny checkpoints and the servers, is in plumbing/rl_demo.py.)
"""

from __future__ import annotations

import time

from vllm.distributed.weight_transfer import (
    HTTPVLLMWeightSyncClient,
    ModuleSource,
    WeightTransferTrainerFactory,
)

import vllm_ascend_rl
from vllm_ascend_rl.client import EngineControlClient
from vllm_ascend_rl.weight_transfer.npu_ipc import NPUIPCTrainerInitInfo

if __package__:  # imported from the repository root: examples.rlhf_http_npu_ipc
    from .plumbing import rl_demo
else:  # run as a script: python examples/rlhf_http_npu_ipc.py
    from plumbing import rl_demo


def main() -> int:
    args = rl_demo.parse_args(__doc__.split("\n\n")[0])
    vllm_ascend_rl.register()  # a trainer is not a vLLM process: register by hand
    with rl_demo.demo(args, "ascend_rl_npu_ipc", sleepable=True) as setup:
        # -- set-up: the control client and the trainer's side of the weight transfer ----
        ctl = EngineControlClient(setup.engine_url)
        trainer = WeightTransferTrainerFactory.trainer_init(
            NPUIPCTrainerInitInfo(rank=0, packed=True),  # one trainer rank per engine chip
            client=HTTPVLLMWeightSyncClient(setup.engine_url),
            source=ModuleSource(setup.policy.model),
        )
        rl_demo.print_header("sleep ms")
        all_ok, validated = True, 0
        for k in range(1, args.steps + 1):
            # -- generate with weights k ----------------------------------------------------
            streams = rl_demo.start_streams(setup.engine_url, args.max_tokens, args.model_name)
            rl_demo.wait_for_tokens(streams, args.min_tokens)

            # -- sleep (pauses, keep) -> train -> wake weights -> sync -> wake KV -> resume --
            t0 = time.perf_counter()
            ctl.sleep(2, mode="keep")  # the KV cache and the weights leave the chip
            sleep_ms = (time.perf_counter() - t0) * 1e3
            split = rl_demo.settled_counts(streams)  # tokens each request had on weights k
            setup.policy.train_step(k)  # the trainer has the chip to itself
            ctl.wake_up(["weights"])
            result = trainer.send_weights(weight_version=f"v{k + 1}")
            ctl.wake_up(["kv_cache"])
            resumed_at = [s.num_tokens for s in streams]  # nothing generated while paused
            ctl.resume()  # a wake keeps the pause taken by the sleep
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
                k, streams, split, resumed_at, sleep_ms, result, matches, args.max_tokens
            )
            validated += matches is not None
        trainer.shutdown()
    return rl_demo.conclude(all_ok, validated, args.steps)


if __name__ == "__main__":
    raise SystemExit(main())
