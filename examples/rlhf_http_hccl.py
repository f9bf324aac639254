"""Async RL with vLLM and the HCCL weight-transfer engine: generate with weights k while the
trainer produces k+1; pause(keep); sync; resume; validate.

With no arguments, on CPU: builds tiny random-weight checkpoints v1..v4, starts a vLLM server on
v1 with ``--weight-transfer-config '{"backend": "hccl"}'`` and the plugin scheduler, and a
reference server used only for validation. This script is the trainer: it holds the policy as a
Hugging Face module and uses only public calls::

    vllm_ascend_rl.register()
    engine = WeightTransferTrainerFactory.trainer_init(HCCLTrainerInitInfo(...),
        client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model))
    engine.send_weights(weight_version=...)

Each step streams requests on weights k while a "training step" (loading checkpoint k+1) runs
in a thread; once every request has some tokens the server is paused with ``mode=keep``, the
weights are sent, and the server resumes. In-flight requests then recompute their context and
continue on the new weights; the reference server on checkpoint k+1 must reproduce every
continuation exactly from prompt + tokens-before-pause. One table row per step.

Real use (e.g. Ascend, a server started by you with the flags above):

    python examples/rlhf_http_hccl.py --server-url http://engine:8000 --model /path/to/hf \\
        --device npu [--reference-url http://ref:8000]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading

import torch

import vllm_ascend_rl
from vllm_ascend_rl.client import EngineControlClient
from vllm_ascend_rl.testing import (
    PLUGIN_SCHEDULER,
    TinyModelSpec,
    VLLMServer,
    build_tiny_model,
    engine_args,
    free_port,
    load_hf_model,
)
from vllm_ascend_rl.testing.rl_step import check_continuations, swap_mid_generation


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server-url", help="a running vLLM server started with the hccl backend")
    ap.add_argument(
        "--reference-url",
        help="server used to validate continuations (with --server-url; skipped if absent)",
    )
    ap.add_argument("--model", help="HF checkpoint the trainer holds (with --server-url)")
    ap.add_argument("--model-name", default="tiny", help="served model name")
    ap.add_argument("--device", choices=["cpu", "npu"], help="trainer device (default: auto)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--master-address", default="127.0.0.1")
    return ap.parse_args()


class Trainer:
    """Holds the policy; a "training step" loads the next checkpoint (or perturbs the weights
    when no checkpoints are given, as a stand-in for an optimizer step)."""

    def __init__(self, model: torch.nn.Module, checkpoints: list | None) -> None:
        self.model, self.checkpoints = model, checkpoints

    def train_step(self, k: int) -> None:
        with torch.no_grad():
            if self.checkpoints:
                from safetensors.torch import load_file

                state = load_file(os.path.join(self.checkpoints[k + 1], "model.safetensors"))
                self.model.load_state_dict(state, strict=True)
            else:
                gen = torch.Generator().manual_seed(k)
                for p in self.model.parameters():
                    p.add_(1e-3 * torch.randn(p.shape, generator=gen).to(p.dtype))


def run(
    args, engine_url: str, reference_url: str | None, trainer: Trainer, checkpoints: list | None
) -> bool:
    from vllm.distributed.weight_transfer import (
        HTTPVLLMWeightSyncClient,
        ModuleSource,
        WeightTransferTrainerFactory,
    )

    from vllm_ascend_rl.weight_transfer.hccl import HCCLTrainerInitInfo

    workers = EngineControlClient(engine_url).world_size()
    sync_engine = WeightTransferTrainerFactory.trainer_init(
        HCCLTrainerInitInfo(
            master_address=args.master_address,
            master_port=free_port(),
            world_size=workers + 1,
            rank=0,
        ),
        client=HTTPVLLMWeightSyncClient(engine_url),
        source=ModuleSource(trainer.model),
    )
    reference = EngineControlClient(reference_url) if reference_url else None
    print(
        f"{'step':>4} {'weights':>9} {'tokens':>7} {'pause ms':>9} {'sync ms':>8} "
        f"{'GB/s':>6} {'resume ms':>9}  validation"
    )
    all_ok = True
    for k in range(1, args.steps + 1):
        training = threading.Thread(target=trainer.train_step, args=(k,))
        training.start()  # the trainer produces k+1 while the engine generates with k
        version = f"v{k + 1}"
        out = swap_mid_generation(
            engine_url,
            lambda v=version: sync_engine.send_weights(weight_version=v),
            max_tokens=args.max_tokens,
            model=args.model_name,
            before_pause=training.join,
        )
        if reference is not None and checkpoints:
            if k > 1:
                reference.reload_weights(str(checkpoints[k + 1]))
            matches = check_continuations(reference_url, out, model=args.model_name)
            verdict = f"{sum(matches)}/{len(matches)} continuations exact"
            ok = all(matches) and not out.problems
        else:
            verdict, ok = "skipped (no reference)", not out.problems
        if out.problems:
            verdict += "; " + "; ".join(out.problems)
        all_ok &= ok
        r = out.sync_result
        print(
            f"{k:>4} {f'v{k}->{version}':>9} {out.tokens:>7} {out.pause_ms:>9.1f} "
            f"{out.sync_ms:>8.1f} {r.gbps:>6.2f} {out.resume_ms:>9.1f}  "
            f"{'PASS' if ok else 'FAIL'} {verdict}"
        )
    sync_engine.shutdown()
    print("all steps validated" if all_ok else "VALIDATION FAILED")
    return all_ok


def main() -> int:
    args = parse_args()
    if args.device:
        os.environ["VLLM_ASCEND_RL_DEVICE"] = args.device
    vllm_ascend_rl.register()
    if args.server_url:
        if not args.model:
            sys.exit("--server-url needs --model (the checkpoint the trainer holds)")
        model = load_hf_model(args.model)
        if args.device == "npu":
            model = model.to("npu")
        return (
            0 if run(args, args.server_url, args.reference_url, Trainer(model, None), None) else 1
        )

    checkpoints = [None] + [
        build_tiny_model(TinyModelSpec(seed=k)) for k in range(1, args.steps + 2)
    ]
    print(f"checkpoints v1..v{args.steps + 1}: {checkpoints[1].parent}")
    engine = VLLMServer(
        checkpoints[1],
        extra_args=[
            *engine_args(),
            "--scheduler-cls",
            PLUGIN_SCHEDULER,
            "--weight-transfer-config",
            '{"backend": "hccl"}',
        ],
    )
    reference = VLLMServer(checkpoints[2], extra_args=engine_args())
    try:
        print("starting the engine (v1, hccl) and a reference server (validation only) ...")
        engine.start(wait=False)
        reference.start(wait=False)
        engine.wait_healthy()
        reference.wait_healthy()
        trainer = Trainer(load_hf_model(checkpoints[1]), checkpoints)
        ok = run(args, engine.url, reference.url, trainer, checkpoints)
    finally:
        engine.stop()
        reference.stop()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
