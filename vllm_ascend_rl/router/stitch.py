"""What the router makes of a bounced completion: the pieces each engine call produced, and
the body of the next call (prompt + tokens so far, the tokens still to generate)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_ascend_rl.core import BOUNCE_FINISH_REASON, BOUNCE_STOP_REASON


class RouterError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Piece:
    """What one engine call produced of a routed completion."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: Any = None
    prompt_token_ids: list[int] | None = None
    usage: dict | None = None

    @property
    def bounced(self) -> bool:
        return (self.finish_reason, self.stop_reason) == (BOUNCE_FINISH_REASON, BOUNCE_STOP_REASON)

    def add(self, choice: dict) -> None:
        """Take in a choice of an engine's answer, whole or one chunk of a stream; not its text,
        which the caller keeps (a stream's would be copied on every chunk)."""
        self.token_ids += choice.get("token_ids") or []
        if self.prompt_token_ids is None:
            self.prompt_token_ids = choice.get("prompt_token_ids")
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
            self.stop_reason = choice.get("stop_reason")


class Completion:
    """One client completion: the body for the next engine call, and how many resends."""

    def __init__(self, body: dict, max_resends: int) -> None:
        if body.get("n", 1) != 1 or body.get("best_of", 1) not in (None, 1):
            raise RouterError(400, "the router routes n=1 completions only")
        prompt = body.get("prompt")
        one_text = isinstance(prompt, str)
        one_ids = isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
        if not (one_text or one_ids) or (one_ids and not prompt):
            raise RouterError(400, "the router routes one prompt (a string or token ids)")
        self.client_body = body
        self.max_resends = max_resends
        self.resends = 0
        self.prompt_ids: list[int] | None = prompt if one_ids else None
        self.generated: list[int] = []

    def next_body(self, stream: bool) -> dict:
        body = dict(self.client_body, return_token_ids=True, stream=stream)
        if self.generated:
            assert self.prompt_ids is not None  # absorb() resends only knowing the prompt's ids
            body["prompt"] = self.prompt_ids + self.generated
            for key in ("max_tokens", "min_tokens"):
                if body.get(key) is not None:
                    body[key] = max(0, body[key] - len(self.generated))
            body.pop("echo", None)
        return body

    def absorb(self, piece: Piece) -> bool:
        """Record a piece; True if it bounced and may be resent."""
        if self.prompt_ids is None:
            self.prompt_ids = piece.prompt_token_ids
        self.generated += piece.token_ids
        if not piece.bounced or self.prompt_ids is None or self.resends >= self.max_resends:
            return False
        remaining = self.client_body.get("max_tokens")
        if remaining is not None and len(self.generated) >= remaining:
            return False
        self.resends += 1
        return True

    def usage(self, last: dict | None) -> dict | None:
        if last is None:
            return None
        prompt, completion = len(self.prompt_ids or []), len(self.generated)
        total = prompt + completion
        return dict(last, prompt_tokens=prompt, completion_tokens=completion, total_tokens=total)

    def shape_choice(self, choice: dict) -> dict:
        """Drop the token ids we asked for if the client did not ask for them."""
        if not self.client_body.get("return_token_ids"):
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
        return choice


def error_body(status: int, message: str) -> dict:
    """vLLM's error shape, so clients parse router errors like engine errors."""
    return {"error": {"message": message, "code": status}}


def shift_offsets(logprobs: dict | None, by: int) -> None:
    """Completion logprobs carry text offsets; a resent piece's start at its own text."""
    if logprobs and by and logprobs.get("text_offset"):
        logprobs["text_offset"] = [o + by for o in logprobs["text_offset"]]


def merge_logprobs(acc: dict | None, new: dict | None, text_len: int) -> dict | None:
    """Concatenate the per-token logprob lists of the pieces of one completion."""
    if new is None:
        return acc
    shift_offsets(new, text_len)
    if acc is None:
        return new
    return {k: (acc.get(k) or []) + (v or []) for k, v in new.items()}
