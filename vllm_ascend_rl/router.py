"""A router in front of vLLM engines that turns bounced completions into uninterrupted ones.

An engine in ``recompute_mode=bounce`` finishes a KV-starved request with
``finish_reason="stop"``, ``stop_reason="recomputed"`` and the tokens it generated. This router
resends prompt + generated tokens (as token ids, so nothing is re-tokenized) with the remaining
``max_tokens`` to the least-loaded engine and stitches the pieces, so its client sees one
completion: one id, one stream, all the tokens, usage counted against the original prompt.

    python -m vllm_ascend_rl.router --engines http://h1:8000,http://h2:8000 --port 9000

``POST /v1/completions`` (one prompt, string or token ids; ``n=1``; streaming or not) is
routed this way. Every other path is forwarded to an engine as is (a bounced chat completion
therefore reaches its client as ``stop_reason="recomputed"``). ``GET /router/stats`` reports
the requests and resends per engine.
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from vllm_ascend_rl.core import BOUNCE_STOP_REASON


class RouterError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Engines:
    urls: list[str]
    in_flight: dict[str, int] = field(default_factory=dict)
    requests: dict[str, int] = field(default_factory=dict)
    resends: int = 0
    _tie: itertools.count = field(default_factory=itertools.count)

    def pick(self) -> str:
        """Fewest requests in flight through this router; ties rotate."""
        low = min(self.in_flight.get(u, 0) for u in self.urls)
        tied = [u for u in self.urls if self.in_flight.get(u, 0) == low]
        return tied[next(self._tie) % len(tied)]


@dataclass
class Piece:
    """What one engine call produced of a routed completion."""

    token_ids: list[int]
    text: str
    finish_reason: str | None
    stop_reason: Any
    prompt_token_ids: list[int] | None
    usage: dict | None = None

    @property
    def bounced(self) -> bool:
        return self.finish_reason == "stop" and self.stop_reason == BOUNCE_STOP_REASON


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
        prompt = len(self.prompt_ids or [])
        return dict(
            last,
            prompt_tokens=prompt,
            completion_tokens=len(self.generated),
            total_tokens=prompt + len(self.generated),
        )

    def shape_choice(self, choice: dict) -> dict:
        """Drop the token ids we asked for if the client did not ask for them."""
        if not self.client_body.get("return_token_ids"):
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
        return choice


def error_body(status: int, message: str) -> dict:
    """vLLM's error shape, so clients parse router errors like engine errors."""
    return {"error": {"message": message, "code": status}}


def _piece(choice: dict, usage: dict | None = None) -> Piece:
    return Piece(
        token_ids=list(choice.get("token_ids") or []),
        text=choice.get("text") or "",
        finish_reason=choice.get("finish_reason"),
        stop_reason=choice.get("stop_reason"),
        prompt_token_ids=choice.get("prompt_token_ids"),
        usage=usage,
    )


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


def build_app(urls: list[str], max_resends: int = 16, timeout_s: float = 3600) -> FastAPI:
    engines = Engines([u.rstrip("/") for u in urls])
    sessions: list[aiohttp.ClientSession] = []  # one, made inside the server's event loop

    def session() -> aiohttp.ClientSession:
        if not sessions:
            sessions.append(aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)))
        return sessions[0]

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        for s in sessions:
            await s.close()

    app = FastAPI(title="vllm_ascend_rl router", lifespan=lifespan)

    async def release(url: str, resp: aiohttp.ClientResponse) -> None:
        engines.in_flight[url] -= 1
        resp.release()

    async def call(completion: Completion, stream: bool) -> tuple[str, aiohttp.ClientResponse]:
        url = engines.pick()
        engines.in_flight[url] = engines.in_flight.get(url, 0) + 1
        engines.requests[url] = engines.requests.get(url, 0) + 1
        try:
            resp = await session().post(url + "/v1/completions", json=completion.next_body(stream))
        except (aiohttp.ClientError, TimeoutError) as e:
            engines.in_flight[url] -= 1
            raise RouterError(502, f"engine {url} failed: {type(e).__name__}: {e}") from e
        if resp.status != 200:
            text = await resp.text()
            await release(url, resp)
            raise RouterError(resp.status, text)
        return url, resp

    async def complete(completion: Completion) -> dict:
        text, first, logprobs = "", None, None
        while True:
            url, resp = await call(completion, stream=False)
            try:
                data = await resp.json()
            except (aiohttp.ClientError, TimeoutError, ValueError) as e:
                raise RouterError(502, f"engine {url} failed mid-response: {e}") from e
            finally:
                await release(url, resp)
            first = first or data
            choice = data["choices"][0]
            piece = _piece(choice, data.get("usage"))
            logprobs = merge_logprobs(logprobs, choice.get("logprobs"), len(text))
            text += piece.text
            again = completion.absorb(piece)
            if not again:
                break
            engines.resends += 1
        choice = dict(choice, text=text, token_ids=completion.generated, logprobs=logprobs)
        choice["prompt_token_ids"] = completion.prompt_ids
        return dict(
            first,
            choices=[completion.shape_choice(choice)],
            usage=completion.usage(data.get("usage")),
        )

    async def stream(completion: Completion) -> AsyncIterator[bytes]:
        """The stitched stream; a failure ends it with an error event, never silently."""
        try:
            async for event in stitched(completion):
                yield event
        except (RouterError, aiohttp.ClientError, TimeoutError) as e:
            status = e.status if isinstance(e, RouterError) else 502
            yield f"data: {json.dumps(error_body(status, f'router: {e}'))}\n\n".encode()
            yield b"data: [DONE]\n\n"

    async def stitched(completion: Completion) -> AsyncIterator[bytes]:
        first_id, text_len = None, 0
        while True:
            url, resp = await call(completion, stream=True)
            piece = Piece([], "", None, None, None)
            held: dict | None = None  # the finishing chunk, sent only if not a bounce
            try:
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    first_id = first_id or chunk.get("id")
                    chunk["id"] = first_id
                    if chunk.get("usage") and not chunk.get("choices"):
                        piece.usage = chunk["usage"]
                        continue
                    for choice in chunk.get("choices", []):
                        piece.token_ids += choice.get("token_ids") or []
                        if piece.prompt_token_ids is None:
                            piece.prompt_token_ids = choice.get("prompt_token_ids")
                        if choice.get("finish_reason") is not None:
                            piece.finish_reason = choice["finish_reason"]
                            piece.stop_reason = choice.get("stop_reason")
                        shift_offsets(choice.get("logprobs"), text_len)
                        text_len += len(choice.get("text") or "")
                        completion.shape_choice(choice)
                        if completion.resends:  # the client has the prompt's ids already
                            choice.pop("prompt_token_ids", None)
                    if piece.finish_reason is not None:
                        held = chunk
                    else:
                        yield f"data: {json.dumps(chunk)}\n\n".encode()
            finally:
                await release(url, resp)
            if piece.finish_reason is None:
                raise RouterError(502, f"engine {url} ended the stream without finishing it")
            if completion.absorb(piece):
                engines.resends += 1
                continue
            if held is not None:
                yield f"data: {json.dumps(held)}\n\n".encode()
            if piece.usage is not None:
                usage = {"id": first_id, "choices": [], "usage": completion.usage(piece.usage)}
                yield f"data: {json.dumps(usage)}\n\n".encode()
            yield b"data: [DONE]\n\n"
            return

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        try:
            completion = Completion(await request.json(), max_resends)
            if completion.client_body.get("stream"):
                return StreamingResponse(stream(completion), media_type="text/event-stream")
            return JSONResponse(await complete(completion))
        except RouterError as e:
            return JSONResponse(error_body(e.status, str(e)), e.status)
        except json.JSONDecodeError:
            return JSONResponse(error_body(400, "body is not JSON"), 400)

    @app.get("/router/stats")
    async def stats() -> dict:
        return {"requests": engines.requests, "resends": engines.resends, "engines": engines.urls}

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(path: str, request: Request) -> Response:
        url = engines.pick()
        try:
            async with session().request(
                request.method,
                f"{url}/{path}",
                data=await request.body(),
                params=request.query_params,
                headers={"content-type": request.headers.get("content-type", "application/json")},
            ) as resp:
                return Response(await resp.read(), resp.status, media_type=resp.content_type)
        except (aiohttp.ClientError, TimeoutError) as e:
            return JSONResponse(
                error_body(502, f"engine {url} failed: {type(e).__name__}: {e}"), 502
            )

    return app


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", required=True, help="comma-separated engine base URLs")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=9000)
    ap.add_argument("--max-resends", type=int, default=16, help="per completion")
    ap.add_argument("--timeout-s", type=float, default=3600, help="per engine call")
    args = ap.parse_args(argv)
    import uvicorn

    urls = [u for u in args.engines.split(",") if u]
    uvicorn.run(build_app(urls, args.max_resends, args.timeout_s), host=args.host, port=args.port)


if __name__ == "__main__":
    main()
