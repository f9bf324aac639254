"""The router's stitched stream against a scripted engine (an aiohttp stand-in for vLLM's
``/v1/completions`` stream, so the chunk boundaries are ours to choose)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator

import pytest
from aiohttp import web
from fastapi.testclient import TestClient

from tests.support import free_port
from vllm_ascend_rl.core import BOUNCE_FINISH_REASON, BOUNCE_STOP_REASON
from vllm_ascend_rl.router import build_app

PROMPT = [1, 2, 3]


def chunk(tokens: list[int], finish: str | None = None, stop: str | None = None) -> bytes:
    choice = {"index": 0, "text": "".join(f"<{t}>" for t in tokens), "token_ids": tokens}
    choice |= {"finish_reason": finish, "stop_reason": stop}
    return f"data: {json.dumps({'id': 'x', 'choices': [choice]})}\n\n".encode()


@pytest.fixture
def engine() -> Iterator[tuple[str, list[dict]]]:
    """First call: tokens 10, then 11 and 12 merged into the bounce's chunk (vLLM's output
    collector merges delta outputs a slow reader has not taken). Second call: 13, 14, length."""
    bodies: list[dict] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        bodies.append(await request.json())
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        if len(bodies) == 1:
            script = [chunk([10]), chunk([11, 12], BOUNCE_FINISH_REASON, BOUNCE_STOP_REASON)]
        else:
            script = [chunk([13]), chunk([14], "length")]
        for part in [*script, b"data: [DONE]\n\n"]:
            await resp.write(part)
        return resp

    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    port = free_port()
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", port).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}", bodies
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_tokens_in_a_bounce_chunk_reach_the_client_once(engine):
    url, bodies = engine
    body = {"prompt": PROMPT, "max_tokens": 5, "stream": True, "return_token_ids": True}
    with (
        TestClient(build_app([url])) as client,
        client.stream("POST", "/v1/completions", json=body) as r,
    ):
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    choices = [c for e in events[:-1] for c in json.loads(e)["choices"]]
    assert [t for c in choices for t in c["token_ids"]] == [10, 11, 12, 13, 14]
    assert "".join(c["text"] for c in choices) == "<10><11><12><13><14>"
    assert [c["finish_reason"] for c in choices] == [None, None, None, "length"]
    assert bodies[1]["prompt"] == [*PROMPT, 10, 11, 12] and bodies[1]["max_tokens"] == 2
