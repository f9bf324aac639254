"""One async-RL weight swap against a live server, and its validation.

``swap_mid_generation`` streams several requests, and once each has at least ``min_tokens``
tokens it runs ``/pause?mode=keep`` -> ``sync()`` -> ``/resume``. Every request must then finish
with all its tokens. ``check_continuations`` is the seed's phase 2: greedy generation with the
new weights from ``prompt + tokens before the pause`` must reproduce the tokens after the pause.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from tests.support.streams import StreamingCompletion, greedy_token_ids, settled
from vllm_ascend_rl.client import EngineControlClient

PROMPTS = (
    "The weather today is",
    "Once upon a time there was",
    "In reinforcement learning, the policy",
    "def fibonacci(n):",
)


@dataclass
class SwapOutcome:
    streams: list[StreamingCompletion]
    split: list[int]  # tokens each request had when the pause completed
    pause_ms: float
    sync_ms: float
    resume_ms: float
    sync_result: Any = None
    problems: list[str] = field(default_factory=list)

    def before(self, i: int) -> list[int]:
        return self.streams[i].token_ids[: self.split[i]]

    def after(self, i: int) -> list[int]:
        return self.streams[i].token_ids[self.split[i] :]

    @property
    def tokens(self) -> int:
        return sum(s.num_tokens for s in self.streams)


def _pause_with_tokens(
    url: str,
    streams: Sequence[StreamingCompletion],
    min_tokens: int,
    max_tokens: int,
    clear_cache: bool,
    timeout_s: float,
) -> tuple[list[int], float]:
    """Resume the engine at ``url`` and pause it (keep) once each of its ``streams`` has
    ``min_tokens``, or one has finished. Returns the settled counts and the last pause's ms.

    On a loaded machine the client can see tokens long after the server produced them, so
    waiting for ``min_tokens`` on the client may be too late. This probes instead: pause,
    read the settled counts, too few → resume and pause again a little later (a pause/resume
    without a sync is harmless)."""
    ctl = EngineControlClient(url, timeout_s=timeout_s)
    probe_s, pause_ms, split = 0.05, 0.0, [0] * len(streams)
    for _probe in range(40):
        ctl.resume()
        time.sleep(probe_s)
        t0 = time.perf_counter()
        ctl.pause("keep", clear_cache=clear_cache)
        pause_ms = (time.perf_counter() - t0) * 1e3
        split = settled(lambda: [s.num_tokens for s in streams], url)
        if min(split) >= min_tokens or max(split) >= max_tokens:
            break
        probe_s = min(2 * probe_s, 0.25)  # capped: the stream must not finish in one interval
    return split, pause_ms


def pause_each_mid_generation(
    urls: Sequence[str],
    streams: Sequence[StreamingCompletion],
    min_tokens: int,
    max_tokens: int,
    *,
    clear_cache: bool = True,
    timeout_s: float = 300,
) -> tuple[list[int], float]:
    """Streams dealt round-robin over ``urls`` (``streams[i]`` on ``urls[i % len(urls)]``),
    admitted behind a pause: resume each engine and pause it again (keep) once each of its
    streams has ``min_tokens``, one thread per engine (engines on separate cores can run at very
    different speeds on a busy host, and one slow engine must not delay another's pause).
    Returns every stream's settled count and the slowest engine's last pause in ms."""
    served = {u: [i for i in range(len(streams)) if urls[i % len(urls)] == u] for u in urls}
    with ThreadPoolExecutor(len(urls)) as pool:
        paused = {
            u: pool.submit(
                _pause_with_tokens,
                u,
                [streams[i] for i in served[u]],
                min_tokens,
                max_tokens,
                clear_cache,
                timeout_s,
            )
            for u in urls
        }
    split = [0] * len(streams)
    for u, future in paused.items():
        for i, n in zip(served[u], future.result()[0], strict=True):
            split[i] = n
    return split, max(f.result()[1] for f in paused.values())


def swap_mid_generation(
    url: str | Sequence[str],
    sync: Callable[[], Any],
    *,
    prompts: Sequence[str] = PROMPTS,
    max_tokens: int = 600,
    min_tokens: int = 8,
    clear_cache: bool = True,
    model: str = "tiny",
    timeout_s: float = 300,
    attempts: int = 5,
) -> SwapOutcome:
    """Stream ``prompts``; pause(keep) once each has ``min_tokens``; ``sync()``; resume.

    With several engines (``url`` a list, as behind an external load balancer) each is paused
    on its own (``pause_each_mid_generation``) and the resume fans out to all of them. A
    request that finished before its engine's pause → resume and retry the round.
    """
    urls = [url] if isinstance(url, str) else list(url)
    ctl = EngineControlClient(urls, timeout_s=timeout_s)
    # The first streams a server serves can reach the client late (lazy set-up in the API
    # server): a probe then reads no tokens while the engine finishes every request. Warm the
    # streaming path up first.
    warms = [StreamingCompletion(u, prompts[0], 4, model=model) for u in urls]
    for warm in warms:
        warm.start()
    for warm in warms:
        warm.join(timeout_s)
    for attempt in range(attempts):
        streams = [
            StreamingCompletion(urls[i % len(urls)], p, max_tokens, model=model)
            for i, p in enumerate(prompts)
        ]
        # Admit the requests together (queued behind a pause): they decode in lockstep.
        ctl.pause("keep")
        for s in streams:
            s.start()
        time.sleep(0.3)
        split, pause_ms = pause_each_mid_generation(
            urls, streams, min_tokens, max_tokens, clear_cache=clear_cache, timeout_s=timeout_s
        )
        if max(split) >= max_tokens and attempt + 1 < attempts:
            ctl.resume()  # too late: a request already finished; retry
            for s in streams:
                s.join(timeout_s)
            continue
        t2 = time.perf_counter()
        result = sync()
        t3 = time.perf_counter()
        during = [s.num_tokens for s in streams]  # nothing may be generated while paused
        ctl.resume()
        t4 = time.perf_counter()
        for s in streams:
            s.join(timeout_s)
        break
    out = SwapOutcome(streams, split, pause_ms, (t3 - t2) * 1e3, (t4 - t3) * 1e3, result)
    if during != split:
        out.problems.append(f"tokens arrived while paused: {split} at the pause, {during} after")
    for i, s in enumerate(streams):
        if not s.ok or s.finish_reason != "length" or s.num_tokens != max_tokens:
            out.problems.append(
                f"request {i}: finish={s.finish_reason} tokens={s.num_tokens}"
                f"/{max_tokens} error={s.error}"
            )
        if split[i] >= max_tokens:
            out.problems.append(
                f"request {i} finished before the pause (split {split}, attempts {attempts})"
            )
    return out


def _admitted_together(url: str, prompts: Sequence[str], max_tokens: int, model: str):
    """``prompts`` streamed from ``url``, admitted behind a pause so they decode in lockstep."""
    ctl = EngineControlClient(url, timeout_s=60)
    streams = [StreamingCompletion(url, p, max_tokens, model=model) for p in prompts]
    ctl.pause("keep")
    for s in streams:
        s.start()
    time.sleep(0.3)
    ctl.resume()
    return streams


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))


def swap_unpaused(
    url: str,
    sync: Callable[[], Any],
    *,
    prompts: Sequence[str] = PROMPTS,
    max_tokens: int = 600,
    min_tokens: int = 8,
    model: str = "tiny",
    timeout_s: float = 300,
    attempts: int = 5,
    restore: Callable[[], Any] | None = None,
) -> SwapOutcome:
    """Stream ``prompts``; once each has ``min_tokens``, ``sync()`` with generation running (no
    pause). A stream's split is where it leaves the old weights' tokens, which a first run of the
    same batch on the old weights gives; ``check_continuations`` then checks the rest.
    ``restore()`` puts the old weights back: then a round in which some stream ended before the
    sync landed (the API server can deliver tokens seconds after its engine made them) is run
    again."""
    old = _admitted_together(url, prompts, max_tokens, model)
    for s in old:
        s.join(timeout_s)
    for attempt in range(attempts):
        streams = _admitted_together(url, prompts, max_tokens, model)
        deadline = time.monotonic() + timeout_s
        while min(s.num_tokens for s in streams) < min_tokens and time.monotonic() < deadline:
            time.sleep(0.002)
        seen = [s.num_tokens for s in streams]
        if max(seen) >= max_tokens and attempt + 1 < attempts:
            for s in streams:
                s.join(timeout_s)
            continue  # a stream ended before the sync: retry
        t0 = time.perf_counter()
        result = sync()
        sync_ms = (time.perf_counter() - t0) * 1e3
        for s in streams:
            s.join(timeout_s)
        split = [
            _first_difference(s.token_ids, o.token_ids) for s, o in zip(streams, old, strict=True)
        ]
        if restore is None or max(split) < max_tokens or attempt + 1 == attempts:
            break
        restore()  # a stream ended on the old weights before the sync reached its engine
    out = SwapOutcome(streams, split, 0.0, sync_ms, 0.0, result)
    for i, s in enumerate(streams):
        if not s.ok or s.finish_reason != "length" or s.num_tokens != max_tokens:
            out.problems.append(f"request {i}: finish={s.finish_reason} tokens={s.num_tokens}")
        if not seen[i] <= split[i] < max_tokens:
            out.problems.append(
                f"request {i}: left the old weights' tokens at {split[i]}, after {seen[i]} "
                f"tokens were seen before the sync (attempts {attempts})"
            )
    return out


def check_continuations(
    reference_url: str, outcome: SwapOutcome, model: str = "tiny", *, together: bool = False
) -> list[bool]:
    """Per request: does greedy on the reference, from prompt + before, give exactly after?

    ``together``: the references run as one batch, admitted behind a pause so they decode in
    lockstep as the swapped requests did after the resume. Some CPU kernels (TP=2 on AMX
    hosts) round differently with the batch's shape, so a long greedy run from a batch of one
    can part from the batch's at a near-tie, tens of tokens in, with the weights right."""
    if together:
        return _continuations_together(reference_url, outcome, model)
    matches = []
    for i, s in enumerate(outcome.streams):
        assert s.prompt_token_ids is not None, "server did not return prompt_token_ids"
        after = outcome.after(i)
        ref = greedy_token_ids(
            reference_url, s.prompt_token_ids + outcome.before(i), len(after), model=model
        )
        matches.append(ref == after)
    return matches


def _continuations_together(url: str, outcome: SwapOutcome, model: str) -> list[bool]:
    ctl = EngineControlClient(url, timeout_s=300)
    refs = []
    for i, s in enumerate(outcome.streams):
        assert s.prompt_token_ids is not None, "server did not return prompt_token_ids"
        prompt = s.prompt_token_ids + outcome.before(i)
        refs.append(StreamingCompletion(url, prompt, len(outcome.after(i)), model=model))
    ctl.pause("keep")  # clears the KV and prefix caches: every reference prefills afresh
    try:
        for r in refs:
            r.start()
        time.sleep(0.3)
    finally:
        ctl.resume()
    for r in refs:
        r.join(300)
    return [r.token_ids == outcome.after(i) for i, r in enumerate(refs)]
