"""Pause (keep) and resume a vLLM server mid-generation, with the plugin's scheduler.

With no arguments, on CPU: builds a tiny random-weight model, starts a vLLM server with
``--scheduler-cls vllm_ascend_rl.core.recompute_scheduler.AsyncRecomputeScheduler``, streams
several requests, pauses with ``mode=keep`` once each has some tokens, checks that nothing is
generated while paused, resumes, and prints one row per request. Exits non-zero if a request
lost or duplicated tokens.

    python examples/pause_resume_demo.py                      # self-contained CPU run
    python examples/pause_resume_demo.py --server-url http://host:8000 --model-name my-model
"""

from __future__ import annotations

import argparse
import sys
import time

from vllm_ascend_rl.client import EngineControlClient

if __package__:  # imported from the repository root: examples.pause_resume_demo
    from . import plumbing  # the server launcher, the tiny model and the stream client
else:  # run as a script: python examples/pause_resume_demo.py
    import plumbing

PROMPTS = [
    "The weather today is",
    "Once upon a time",
    "In reinforcement learning, the policy",
    "def fibonacci(n):",
]


def run(url: str, model_name: str, max_tokens: int, min_tokens: int) -> bool:
    ctl = EngineControlClient(url, timeout_s=120)
    streams = [plumbing.StreamingCompletion(url, p, max_tokens, model=model_name) for p in PROMPTS]
    for s in streams:
        s.start()
    for s in streams:
        if not s.wait_for_tokens(min_tokens, timeout_s=120):
            print(f"request did not reach {min_tokens} tokens: {s.error}", file=sys.stderr)
            return False

    t0 = time.perf_counter()
    ctl.pause("keep")
    pause_ms = (time.perf_counter() - t0) * 1e3
    time.sleep(0.3)  # let chunks already on the wire arrive
    at_pause = [s.num_tokens for s in streams]
    time.sleep(1.0)
    frozen = [s.num_tokens for s in streams] == at_pause
    t0 = time.perf_counter()
    ctl.resume()
    resume_ms = (time.perf_counter() - t0) * 1e3
    for s in streams:
        s.join(300)

    ok = frozen
    print(
        f"pause(keep) {pause_ms:.1f} ms, resume {resume_ms:.1f} ms, "
        f"frozen while paused: {'yes' if frozen else 'NO'}"
    )
    print(f"{'request':<8}{'before pause':>14}{'after resume':>14}{'total':>8}  finish")
    for i, (s, before) in enumerate(zip(streams, at_pause, strict=True)):
        good = s.ok and s.finish_reason == "length" and s.num_tokens == max_tokens
        ok &= good
        print(
            f"{i:<8}{before:>14}{s.num_tokens - before:>14}{s.num_tokens:>8}  "
            f"{s.finish_reason}{'' if good else '  <-- FAILED ' + str(s.error)}"
        )
    print("PASS" if ok else "FAIL")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server-url", help="use this running server instead of starting one")
    ap.add_argument("--model-name", default="tiny", help="served model name on --server-url")
    ap.add_argument("--max-tokens", type=int, default=600)
    ap.add_argument(
        "--min-tokens", type=int, default=20, help="tokens each request has before the pause"
    )
    args = ap.parse_args()
    if args.server_url:
        return 0 if run(args.server_url, args.model_name, args.max_tokens, args.min_tokens) else 1

    model = plumbing.build_tiny_model()
    print(f"tiny model: {model}\nstarting vLLM server with {plumbing.PLUGIN_SCHEDULER} ...")
    with plumbing.VLLMServer(
        model, extra_args=[*plumbing.engine_args(), "--scheduler-cls", plumbing.PLUGIN_SCHEDULER]
    ) as server:
        print(f"server up at {server.url} (log: {server.log_path})")
        ok = run(server.url, "tiny", args.max_tokens, args.min_tokens)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
