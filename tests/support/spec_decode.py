"""Speculative decoding in the e2e suite and the benchmark: the tiny target and drafter pair on
v1 and v2 (``tiny_model.spec_decode_pair``), an engine serving them, and the acceptance rate
from vLLM's spec-decode counters on ``/metrics``."""

from __future__ import annotations

import json
import time
from pathlib import Path

import requests

from tests.support import VLLMServer, build_model_pair, greedy_token_ids, rl_engine_args
from tests.support.tiny_model import spec_decode_pair
from vllm_ascend_rl.client import EngineControlClient

PROMPTS = ["The drafter proposes", "Tokens accepted", "A trainer sends", "Speculative"]
COUNTERS = ("vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total")


def models() -> tuple[tuple[Path, Path], tuple[Path, Path]]:
    """((target v1, drafter v1), (target v2, drafter v2))."""
    v1, v2 = build_model_pair()
    return spec_decode_pair(v1), spec_decode_pair(v2)


def draft_server(backend: str, log_path: Path, *, sleepable: bool) -> VLLMServer:
    """An RL engine on target v1 with drafter v1 (method ``draft_model``, 3 tokens a step),
    whose workers answer ``drafter_checksum`` (``tests.support.draft_probe``)."""
    (target, drafter), _ = models()
    speculative = {"method": "draft_model", "model": str(drafter), "num_speculative_tokens": 3}
    args = [
        *rl_engine_args(backend, sleepable=sleepable),
        *("--speculative-config", json.dumps(speculative)),
        *("--worker-extension-cls", "tests.support.draft_probe.DraftProbe"),
    ]
    return VLLMServer(target, log_path=log_path, extra_args=args)


def spec_counts(url: str) -> tuple[float, float]:
    """(draft tokens, accepted tokens) so far, once the counters stopped moving."""
    last = None
    for _ in range(40):
        text = requests.get(url + "/metrics", timeout=30).text
        now = tuple(
            sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))
            for name in COUNTERS
        )
        if now == last:
            return now
        last = now
        time.sleep(0.25)
    raise AssertionError(f"the spec-decode counters never settled: {last}")


def acceptance(url: str, max_tokens: int = 48) -> tuple[float, float]:
    """(accepted / drafted tokens, generated tokens per second) over greedy completions of
    ``PROMPTS``, one after another."""
    drafted, accepted = spec_counts(url)
    started, generated = time.perf_counter(), 0
    for prompt in PROMPTS:
        generated += len(greedy_token_ids(url, prompt, max_tokens))
    seconds = time.perf_counter() - started
    drafted_after, accepted_after = spec_counts(url)
    assert drafted_after > drafted, "no token was drafted"
    return (accepted_after - accepted) / (drafted_after - drafted), generated / seconds


def drafter_checksums(url: str) -> dict[str, str]:
    """The drafter's parameters' digests, by name (``DraftProbe``)."""
    return EngineControlClient(url).collective_rpc("drafter_checksums")[0][0]
