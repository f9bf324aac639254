"""A router in front of vLLM engines that turns bounced completions into uninterrupted ones.

    python -m vllm_ascend_rl.router --engines http://h1:8000,http://h2:8000 --port 9000

A bounced ``POST /v1/completions`` (one prompt, ``n=1``) is resent as prompt + generated token
ids to the least-loaded engine and stitched into one completion. Other data-plane paths go to
one engine; control routes (:data:`FANNED_OUT`) to every engine, all or nothing; any other path
is refused with 403, as each engine needs its own call. See docs/scheduler.md#the-router.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from vllm_ascend_rl.client import EngineControlClient, EngineControlError, EnginesDisagree
from vllm_ascend_rl.metrics import Collector, Row
from vllm_ascend_rl.router.stitch import (
    Completion,
    Piece,
    RouterError,
    error_body,
    merge_logprobs,
    shift_offsets,
)

# Routes that go to every engine, with the all-or-nothing rule of EngineControlClient.
FANNED_OUT = (
    "/pause",
    "/resume",
    "/is_paused",
    "/sleep",
    "/wake_up",
    "/is_sleeping",
    "/reset_prefix_cache",
)
# Paths that may go to any one engine; everything else is refused.
DATA_PLANE_PREFIXES = ("/v1/", "/v2/")
DATA_PLANE_PATHS = ("/health", "/ping", "/metrics", "/version", "/tokenize", "/detokenize")


def is_data_plane(path: str) -> bool:
    return path.startswith(DATA_PLANE_PREFIXES) or path in DATA_PLANE_PATHS


@dataclass
class Engines:
    urls: list[str]
    in_flight: Counter[str] = field(default_factory=Counter)
    requests: Counter[str] = field(default_factory=Counter)
    resends: int = 0
    _tie: itertools.count = field(default_factory=itertools.count)

    def pick(self) -> str:
        """Fewest requests in flight through this router; ties rotate."""
        low = min(self.in_flight[u] for u in self.urls)
        tied = [u for u in self.urls if self.in_flight[u] == low]
        return tied[next(self._tie) % len(tied)]


def event(data: Any) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


def build_app(urls: list[str], max_resends: int = 16, timeout_s: float = 3600) -> FastAPI:
    engines = Engines([u.rstrip("/") for u in urls])

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # One session for every engine call, made inside the server's event loop.
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
            app.state.session = s
            yield

    app = FastAPI(title="vllm_ascend_rl router", lifespan=lifespan)

    @app.exception_handler(RouterError)
    async def refuse(_request: Request, e: RouterError) -> Response:
        return JSONResponse(error_body(e.status, str(e)), e.status)

    @asynccontextmanager
    async def call(
        completion: Completion, stream: bool
    ) -> AsyncIterator[tuple[str, aiohttp.ClientResponse]]:
        """The next engine call, in flight until its response is released."""
        url = engines.pick()
        engines.in_flight[url] += 1
        engines.requests[url] += 1
        body = completion.next_body(stream)
        try:
            async with app.state.session.post(url + "/v1/completions", json=body) as resp:
                if resp.status != 200:
                    raise RouterError(resp.status, await resp.text())
                yield url, resp
        except (aiohttp.ClientError, TimeoutError) as e:
            raise RouterError(502, f"engine {url} failed: {type(e).__name__}: {e}") from e
        finally:
            engines.in_flight[url] -= 1

    async def complete(completion: Completion) -> dict:
        text, first, logprobs = "", None, None
        while True:
            async with call(completion, stream=False) as (url, resp):
                try:
                    data = await resp.json()
                except (aiohttp.ClientError, TimeoutError, ValueError) as e:
                    raise RouterError(502, f"engine {url} failed mid-response: {e}") from e
            first = first or data
            choice = data["choices"][0]
            piece = Piece(text=choice.get("text") or "", usage=data.get("usage"))
            piece.add(choice)
            logprobs = merge_logprobs(logprobs, choice.get("logprobs"), len(text))
            text += piece.text
            if not completion.absorb(piece):
                break
            engines.resends += 1
        choice = dict(choice, text=text, token_ids=completion.generated, logprobs=logprobs)
        choice["prompt_token_ids"] = completion.prompt_ids
        usage = completion.usage(piece.usage)
        return dict(first, choices=[completion.shape_choice(choice)], usage=usage)

    async def stream(completion: Completion) -> AsyncIterator[bytes]:
        """The stitched stream; a failure ends it with an error event, never silently."""
        try:
            async for data in stitched(completion):
                yield data
        except RouterError as e:  # call() makes the engine's aiohttp errors RouterErrors
            yield event(error_body(e.status, f"router: {e}"))
            yield b"data: [DONE]\n\n"

    async def stitched(completion: Completion) -> AsyncIterator[bytes]:
        first_id, text_len = None, 0
        while True:
            piece = Piece()
            held: dict = {}  # the finishing chunk, sent only if not a bounce
            async with call(completion, stream=True) as (url, resp):
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
                        shift_offsets(choice.get("logprobs"), text_len)
                        text_len += len(choice.get("text") or "")
                        piece.add(choice)
                        completion.shape_choice(choice)
                        if completion.resends:  # the client has the prompt's ids already
                            choice.pop("prompt_token_ids", None)
                    if piece.finish_reason is not None:
                        held = chunk
                    else:
                        yield event(chunk)
            if piece.finish_reason is None:
                raise RouterError(502, f"engine {url} ended the stream without finishing it")
            if not completion.absorb(piece):
                break
            engines.resends += 1
            # vLLM merges delta outputs a slow reader has not taken yet, so the bounce's
            # chunk may carry the last tokens: pass them on without its finish.
            if any(c.get("token_ids") or c.get("text") for c in held["choices"]):
                for choice in held["choices"]:
                    choice["finish_reason"] = choice["stop_reason"] = None
                yield event(held)
        yield event(held)
        if piece.usage is not None:
            yield event({"id": first_id, "choices": [], "usage": completion.usage(piece.usage)})
        yield b"data: [DONE]\n\n"

    async def payload(request: Request, required: bool = False) -> Any:
        body = await request.body()
        try:
            return json.loads(body) if body or required else None
        except json.JSONDecodeError:
            raise RouterError(400, "body is not JSON") from None

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        completion = Completion(await payload(request, required=True), max_resends)
        if completion.client_body.get("stream"):
            return StreamingResponse(stream(completion), media_type="text/event-stream")
        return JSONResponse(await complete(completion))

    @app.get("/router/stats")
    async def stats() -> dict:
        return {"requests": engines.requests, "resends": engines.resends, "engines": engines.urls}

    def rows() -> Iterator[Row]:
        for url, n in engines.requests.items():
            yield ("router_requests", (("engine", url),)), n
        yield ("router_resends", ()), engines.resends

    registry = CollectorRegistry()
    registry.register(Collector(rows))

    @app.get("/router/metrics")
    async def router_metrics() -> Response:
        """The router's counters in Prometheus form (``/metrics`` is an engine's)."""
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def fan_out(request: Request) -> Response:
        """A control route on every engine (see the module docstring)."""
        route, body = request.url.path, await payload(request)
        ctl = EngineControlClient(engines.urls, timeout_s=timeout_s)
        params = list(request.query_params.multi_items())
        try:
            out = await asyncio.to_thread(ctl.request, request.method, route, params, body)
            assert out is not None  # a client of node rank 0 always asks
            agreed = ctl.agreed(out, route)
        except EngineControlError as e:
            failures = getattr(e, "failures", {e.url: e})
            statuses = {f.status for f in failures.values()}
            status = statuses.pop() if len(statuses) == 1 and None not in statuses else 502
            raise RouterError(status, f"router: {e}") from e
        except EnginesDisagree as e:
            raise RouterError(409, f"router: {e}") from e
        return Response(agreed) if isinstance(agreed, str) else JSONResponse(agreed)

    for route in FANNED_OUT:
        app.add_api_route(route, fan_out, methods=["GET", "POST"])

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(path: str, request: Request) -> Response:
        if not is_data_plane("/" + path):
            raise RouterError(
                403,
                f"the router does not forward /{path}: it would reach one of "
                f"{len(engines.urls)} engines. It fans out {', '.join(FANNED_OUT)}; send "
                "weight-transfer calls, /collective_rpc and other control calls to each "
                "engine directly (each has its own rank offset)",
            )
        url = engines.pick()
        try:
            async with app.state.session.request(
                request.method,
                f"{url}/{path}",
                data=await request.body(),
                params=request.query_params,
                headers={"content-type": request.headers.get("content-type", "application/json")},
            ) as resp:
                return Response(await resp.read(), resp.status, media_type=resp.content_type)
        except (aiohttp.ClientError, TimeoutError) as e:
            raise RouterError(502, f"engine {url} failed: {type(e).__name__}: {e}") from e

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
