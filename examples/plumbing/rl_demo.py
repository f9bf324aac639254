"""What the two HTTP RL examples (``rlhf_http_hccl.py``, ``rlhf_http_npu_ipc.py``) share and is
not the point of them.

With no ``--server-url`` the examples run by themselves (on CPU; on an Ascend host on NPUs, each
server on chips of its own): tiny random-weight checkpoints v1..v(steps+1), a vLLM server on v1
(the engine) and one on v2 (the reference, used only to validate, reloaded to each new
checkpoint). The "training step" loads the next checkpoint, or, against your own server, the
next of ``--train-checkpoints``, or else perturbs the weights as a stand-in for an optimizer
step; each runs on the device the trainer sends from (an NPU-IPC trainer on its engine's chip,
an HCCL one on a chip of its own). Without a reference holding the trainer's weights a step is
run but not validated, and the examples say so. Everything else an RL loop does is in the
example files themselves. The servers, the checkpoints and the stream client are the rest of
this package.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from vllm_ascend_rl.client import EngineControlClient
from vllm_ascend_rl.device import device_kind

from . import (
    StreamingCompletion,
    TinyModelSpec,
    VLLMServer,
    build_tiny_model,
    engine_args,
    greedy_token_ids,
    load_hf_model,
    rl_engine_args,
    serving,
)
from .profile import trainer_chip

PROMPTS = (
    "The weather today is",
    "Once upon a time there was",
    "In reinforcement learning, the policy",
    "def fibonacci(n):",
)


def parse_args(description: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--server-url", help="a running vLLM server started with this backend")
    ap.add_argument("--reference-url", help="server to validate continuations against")
    ap.add_argument("--model", help="HF checkpoint the trainer holds (with --server-url)")
    ap.add_argument("--model-name", default="tiny", help="served model name")
    ap.add_argument(
        "--train-checkpoints",
        nargs="+",
        metavar="CHECKPOINT",
        help="with --server-url: what the training steps load in turn, instead of perturbing "
        "the weights, so that a --reference-url server on the first validates every step (it "
        "is reloaded to each next one)",
    )
    ap.add_argument("--device", choices=["cpu", "npu"], help="trainer device (default: auto)")
    ap.add_argument("--steps", type=int, help="default: 3, or one per --train-checkpoints")
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--min-tokens", type=int, default=8, help="per request, before the pause")
    ap.add_argument("--master-address", default="127.0.0.1", help="trainer address (HCCL)")
    args = ap.parse_args()
    if args.train_checkpoints and not args.server_url:
        ap.error("--train-checkpoints goes with --server-url (without, the example builds them)")
    if args.steps is None:
        args.steps = len(args.train_checkpoints) if args.train_checkpoints else 3
    if args.train_checkpoints and args.steps > len(args.train_checkpoints):
        ap.error(f"--steps {args.steps}: only {len(args.train_checkpoints)} --train-checkpoints")
    if args.device:
        os.environ["VLLM_ASCEND_RL_DEVICE"] = args.device
    return args


class Policy:
    """The trainer's model and its stand-in training step, which runs where the model is."""

    def __init__(self, model: torch.nn.Module, checkpoints: list | None) -> None:
        self.model, self.checkpoints = model, checkpoints

    def train_step(self, k: int) -> None:
        """Weights k -> k+1: load checkpoint k+1, or perturb every weight a little (noise
        drawn on each parameter's own device). Raises if the step fails."""
        with torch.no_grad():
            if self.checkpoints:
                from safetensors.torch import load_file

                state = load_file(os.path.join(self.checkpoints[k + 1], "model.safetensors"))
                self.model.load_state_dict(state, strict=True)  # copies onto the parameters
            else:
                generators: dict[torch.device, torch.Generator] = {}
                for p in self.model.parameters():
                    if p.device not in generators:
                        generators[p.device] = torch.Generator(device=p.device).manual_seed(k)
                    noise = torch.randn(p.shape, generator=generators[p.device], device=p.device)
                    p.add_(noise.to(p.dtype), alpha=1e-3)


@dataclass
class Demo:
    engine_url: str
    policy: Policy
    reference_url: str | None

    def reference_for(self, k: int) -> str | None:
        """The reference server on weights k+1 (None: validation is not possible)."""
        if not (self.reference_url and self.policy.checkpoints):
            return None
        if k > 1:  # it starts on v2
            ref = EngineControlClient(self.reference_url)
            ref.reload_weights(str(self.policy.checkpoints[k + 1]))
        return self.reference_url


@contextmanager
def demo(args: argparse.Namespace, backend: str, *, sleepable: bool = False) -> Iterator[Demo]:
    """Your server (``--server-url``), or an engine (``sleepable``: with the device's sleepable
    worker) and a reference built here; the policy on the device the trainer sends from."""
    if args.server_url:
        if not args.model:
            raise SystemExit("--server-url needs --model (the checkpoint the trainer holds)")
        model = load_hf_model(args.model).to(trainer_device())
        trained = [None, args.model, *args.train_checkpoints] if args.train_checkpoints else None
        yield Demo(args.server_url, Policy(model, trained), args.reference_url)
        return
    checkpoints = [None] + [
        build_tiny_model(TinyModelSpec(seed=k)) for k in range(1, args.steps + 2)
    ]
    print(f"checkpoints v1..v{args.steps + 1}: {checkpoints[1].parent}")
    engine = VLLMServer(checkpoints[1], extra_args=rl_engine_args(backend, sleepable=sleepable))
    reference = VLLMServer(checkpoints[2], extra_args=engine_args())
    print(f"starting the engine (v1, {backend}) and a reference server (validation only) ...")
    with serving(engine, reference):
        chip = trainer_chip(engine.chips, colocated=backend == "ascend_rl_npu_ipc")
        model = load_hf_model(checkpoints[1]).to(trainer_device(chip))
        yield Demo(engine.url, Policy(model, checkpoints), reference.url)


def trainer_device(chip: int | None = None) -> torch.device:
    """The device the trainer sends from, made this thread's current one: the CPU, or on NPU
    the visible chip ``chip`` (None: the current one)."""
    if device_kind() != "npu":
        return torch.device("cpu")
    import torch_npu  # noqa: F401  (torch.npu)

    from vllm_ascend_rl.device import current_device

    if chip is not None:
        torch.npu.set_device(chip)
    return current_device().torch_device()


def start_streams(url: str, max_tokens: int, model: str) -> list[StreamingCompletion]:
    """One streaming completion per prompt, started; each counts the tokens it received."""
    streams = [StreamingCompletion(url, p, max_tokens, model=model) for p in PROMPTS]
    for s in streams:
        s.start()
    return streams


def wait_for_tokens(streams: list[StreamingCompletion], n: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while min(s.num_tokens for s in streams) < n and time.monotonic() < deadline:
        time.sleep(0.01)


def settled_counts(streams: list[StreamingCompletion], quiet_s: float = 0.25) -> list[int]:
    """Token counts once none changes for ``quiet_s``: after a pause, the tokens generated
    before it are all that arrive."""
    last = [s.num_tokens for s in streams]
    while True:
        time.sleep(quiet_s)
        now = [s.num_tokens for s in streams]
        if now == last:
            return now
        last = now


def continuation_matches(
    reference_url: str, stream: StreamingCompletion, split: int, model: str
) -> bool:
    """Greedy on the reference from prompt + the tokens before the pause must give exactly
    the tokens after it. A request with no tokens after the pause has nothing to check: False
    (``report`` names why)."""
    before, after = stream.token_ids[:split], stream.token_ids[split:]
    if not after or stream.prompt_token_ids is None:
        return False
    prompt = stream.prompt_token_ids + before
    return greedy_token_ids(reference_url, prompt, len(after), model=model) == after


def conclude(passed: bool, validated: int, steps: int) -> int:
    """Print the run's verdict and return the exit status: 1 if a step failed. Steps that
    had no reference to check against ran, but are reported as not validated."""
    if not passed:
        print("VALIDATION FAILED")
        return 1
    if validated < steps:
        print(
            f"all steps ran; {steps - validated} of {steps} not validated (no reference server "
            "holding the trainer's weights)"
        )
    else:
        print("all steps validated")
    return 0


def print_header(pause_label: str) -> None:
    print(
        f"{'step':>4} {'weights':>9} {'before':>8} {pause_label:>9} {'sync ms':>8} "
        f"{'GB/s':>6}  validation  (before: tokens per request at the pause)"
    )


def report(
    k: int,
    streams: list[StreamingCompletion],
    split: list[int],
    resumed_at: list[int],
    pause_ms: float,
    result,
    matches: list[bool] | None,
    max_tokens: int,
) -> bool:
    """Print step ``k``'s row; True if every request had tokens when paused (``split``), got
    none while paused (``resumed_at``: its count just before the resume), ran to
    ``max_tokens``, and every continuation matched (``matches=None``: nothing to validate
    against)."""
    problems = [
        f"request {i}: {n} tokens at the pause, not mid-generation"
        for i, n in enumerate(split)
        if not 0 < n < max_tokens
    ]
    if resumed_at != split:
        problems.append(f"tokens arrived while paused: {split} at the pause, {resumed_at} after")
    problems += [
        f"request {i}: {s.finish_reason}, {s.num_tokens} tokens, {s.error}"
        for i, s in enumerate(streams)
        if not s.ok or s.num_tokens != max_tokens
    ]
    if matches is None:
        verdict = "skipped (no reference)"
    else:
        verdict = f"{sum(matches)}/{len(matches)} continuations exact"
        problems += [] if all(matches) else ["a continuation differs"]
    print(
        f"{k:>4} {f'v{k}->v{k + 1}':>9} {f'{min(split)}-{max(split)}':>8} {pause_ms:>9.1f} "
        f"{result.seconds * 1e3:>8.1f} {result.gbps:>6.2f}  {'FAIL' if problems else 'PASS'} "
        f"{verdict} {'; '.join(problems)}"
    )
    return not problems
