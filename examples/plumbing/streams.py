"""OpenAI-completions helpers that count token ids, for tests, examples and benchmarks.

After a preemption one SSE chunk can carry several tokens, so progress is measured by the
``token_ids`` the server returns (``return_token_ids``), never by the number of chunks.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import requests


def completion_body(
    prompt: str | list[int],
    max_tokens: int,
    *,
    model: str = "tiny",
    ignore_eos: bool = True,
    stream: bool = False,
    **extra: Any,
) -> dict:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": ignore_eos,
        "return_token_ids": True,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    body.update(extra)
    return body


def complete(
    url: str, prompt: str | list[int], max_tokens: int, *, timeout_s: float = 120, **kwargs: Any
) -> dict:
    """One greedy, non-streaming completion; returns the parsed response (raises on HTTP error)."""
    r = requests.post(
        url.rstrip("/") + "/v1/completions",
        json=completion_body(prompt, max_tokens, **kwargs),
        timeout=timeout_s,
    )
    r.raise_for_status()
    return r.json()


def greedy_token_ids(
    url: str, prompt: str | list[int], max_tokens: int, **kwargs: Any
) -> list[int]:
    return complete(url, prompt, max_tokens, **kwargs)["choices"][0]["token_ids"]


class StreamingCompletion(threading.Thread):
    """A streaming completion running in a daemon thread.

    ``first_token`` is set when the first token id arrives, so callers can prove a request is
    in flight without sleeping. ``token_ids`` grows as tokens arrive; ``token_times`` holds the
    arrival time of each.
    """

    def __init__(
        self,
        url: str,
        prompt: str | list[int],
        max_tokens: int,
        *,
        timeout_s: float = 300,
        **kwargs: Any,
    ) -> None:
        super().__init__(daemon=True)
        self.url = url.rstrip("/") + "/v1/completions"
        self.body = completion_body(prompt, max_tokens, stream=True, **kwargs)
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.first_token = threading.Event()
        self.token_ids: list[int] = []
        self.token_times: list[float] = []
        self.prompt_token_ids: list[int] | None = None
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: Any = None
        self.usage: dict | None = None
        self.status_code: int | None = None
        self.error: str | None = None
        self._lock = threading.Lock()

    @property
    def num_tokens(self) -> int:
        with self._lock:
            return len(self.token_ids)

    def snapshot(self) -> list[int]:
        with self._lock:
            return list(self.token_ids)

    @property
    def ok(self) -> bool:
        return self.status_code == 200 and self.error is None and self.finish_reason is not None

    def run(self) -> None:
        try:
            with requests.post(self.url, json=self.body, stream=True, timeout=self.timeout_s) as r:
                self.status_code = r.status_code
                if r.status_code != 200:
                    self.error = r.text
                    return
                for line in r.iter_lines():
                    if line.startswith(b"data: "):
                        payload = line[len(b"data: ") :]
                        if payload == b"[DONE]":
                            break
                        self._on_chunk(json.loads(payload))
        except Exception as e:  # surfaced to the test through .error
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self.first_token.set()  # never leave a waiter hanging

    def _on_chunk(self, chunk: dict) -> None:
        if "error" in chunk:
            self.error = json.dumps(chunk["error"])
            return
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices", []):
            if choice.get("prompt_token_ids"):
                self.prompt_token_ids = choice["prompt_token_ids"]
            new = choice.get("token_ids") or []
            now = time.monotonic()
            with self._lock:
                self.token_ids.extend(new)
                self.token_times.extend([now] * len(new))
                self.text += choice.get("text") or ""
            if new:
                self.first_token.set()
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
                self.stop_reason = choice.get("stop_reason")

    def wait_for_tokens(self, n: int, timeout_s: float = 60) -> bool:
        """Block until ``n`` token ids have arrived or the stream ended; True if reached."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.num_tokens >= n:
                return True
            if not self.is_alive() and self.ident is not None:
                return self.num_tokens >= n
            time.sleep(0.005)
        return False
