"""The async-RL loop shared by the examples: generate with weights k while the trainer produces
k+1; pause(keep); sync; resume; validate against a reference server.

The examples hold only what differs between transports: how the trainer connects
(``trainer_init`` with its init info) and what happens to the engine while the trainer trains
(nothing for HCCL; sleep and wake for a colocated NPU-IPC trainer).
"""

from __future__ import annotations

import argparse
import os
import threading
from collections.abc import Callable
from typing import Any

import torch

from vllm_ascend_rl import testing
from vllm_ascend_rl.client import EngineControlClient
from vllm_ascend_rl.testing.rl_step import check_continuations, swap_mid_generation
from vllm_ascend_rl.testing.server import VLLMServer, serving
from vllm_ascend_rl.testing.tiny_model import TinyModelSpec, build_tiny_model, load_hf_model

Connect = Callable[[str, torch.nn.Module, argparse.Namespace], Any]  # -> trainer engine


def demo_args(description: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--server-url", help="a running vLLM server started with this backend")
    ap.add_argument(
        "--reference-url",
        help="server used to validate continuations (with --server-url; skipped if absent)",
    )
    ap.add_argument("--model", help="HF checkpoint the trainer holds (with --server-url)")
    ap.add_argument("--model-name", default="tiny", help="served model name")
    ap.add_argument("--device", choices=["cpu", "npu"], help="trainer device (default: auto)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--master-address", default="127.0.0.1", help="trainer address (HCCL)")
    return ap.parse_args()


class Policy:
    """The trainer's model. A "training step" loads the next checkpoint, or, without
    checkpoints, perturbs the weights as a stand-in for an optimizer step."""

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


def run_loop(
    args: argparse.Namespace,
    engine_url: str,
    reference_url: str | None,
    policy: Policy,
    sync_engine,
    *,
    colocated: bool = False,
    sleep_level: int | None = None,
) -> bool:
    """``args.steps`` steps; one printed row each; True if every step validated.

    Separate devices (``colocated=False``): the trainer trains while the engine generates.
    Colocated: the trainer trains inside the pause; with ``sleep_level`` the engine releases
    its memory meanwhile (``/sleep``), wakes its weights before the sync and its KV cache after.
    """
    ctl = EngineControlClient(engine_url)
    reference = EngineControlClient(reference_url) if reference_url else None
    print(
        f"{'step':>4} {'weights':>9} {'tokens':>7} {'pause ms':>9} {'sync ms':>8} "
        f"{'GB/s':>6} {'resume ms':>9}  validation"
    )
    all_ok = True
    for k in range(1, args.steps + 1):
        version = f"v{k + 1}"
        training = None
        if not colocated:  # the trainer produces k+1 while the engine generates with k
            training = threading.Thread(target=policy.train_step, args=(k,))
            training.start()

        def sync(k=k, v=version):
            if colocated:
                if sleep_level is not None:
                    ctl.sleep(sleep_level, mode="keep")
                policy.train_step(k)
                if sleep_level is not None:
                    ctl.wake_up(["weights"])
            result = sync_engine.send_weights(weight_version=v)
            if colocated and sleep_level is not None:
                ctl.wake_up(["kv_cache"])
            return result

        out = swap_mid_generation(
            engine_url,
            sync,
            max_tokens=args.max_tokens,
            model=args.model_name,
            before_pause=training.join if training else None,
        )
        if reference is not None and policy.checkpoints:
            if k > 1:
                reference.reload_weights(str(policy.checkpoints[k + 1]))
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
            f"{1e3 * r.seconds:>8.1f} {r.gbps:>6.2f} {out.resume_ms:>9.1f}  "
            f"{'PASS' if ok else 'FAIL'} {verdict}"
        )
    sync_engine.shutdown()
    print("all steps validated" if all_ok else "VALIDATION FAILED")
    return all_ok


def demo_main(
    args: argparse.Namespace,
    backend: str,
    connect: Connect,
    engine_flags: list[str] = (),
    **loop_options,
) -> int:
    """Run the loop against ``--server-url``, or on CPU with self-built tiny checkpoints."""
    if args.device:
        os.environ["VLLM_ASCEND_RL_DEVICE"] = args.device
    import vllm_ascend_rl

    vllm_ascend_rl.register()
    if args.server_url:
        if not args.model:
            raise SystemExit("--server-url needs --model (the checkpoint the trainer holds)")
        model = load_hf_model(args.model)
        if args.device == "npu":
            model = model.to("npu")
        sync_engine = connect(args.server_url, model, args)
        ok = run_loop(
            args,
            args.server_url,
            args.reference_url,
            Policy(model, None),
            sync_engine,
            **loop_options,
        )
        return 0 if ok else 1

    checkpoints = [None] + [
        build_tiny_model(TinyModelSpec(seed=k)) for k in range(1, args.steps + 2)
    ]
    print(f"checkpoints v1..v{args.steps + 1}: {checkpoints[1].parent}")
    engine = VLLMServer(
        checkpoints[1],
        extra_args=[
            *testing.engine_args(),
            "--scheduler-cls",
            testing.PLUGIN_SCHEDULER,
            *engine_flags,
            "--weight-transfer-config",
            f'{{"backend": "{backend}"}}',
        ],
    )
    reference = VLLMServer(checkpoints[2], extra_args=testing.engine_args())
    print(f"starting the engine (v1, {backend}) and a reference server (validation only) ...")
    with serving(engine, reference):
        policy = Policy(load_hf_model(checkpoints[1]), checkpoints)
        sync_engine = connect(engine.url, policy.model, args)
        ok = run_loop(args, engine.url, reference.url, policy, sync_engine, **loop_options)
    return 0 if ok else 1
