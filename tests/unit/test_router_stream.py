"""The router's stitched stream against a scripted engine (an aiohttp stand-in for vLLM's
``/v1/completions`` stream, so the chunk boundaries are ours to choose)."""

from __future__ import annotations

import asyncio
import json
import socket
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


def raw_engine(answers: list[bytes]) -> tuple[str, socket.socket]:
    """An engine that writes ``answers[k]`` (raw HTTP) to its k-th connection and closes it."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        for answer in answers:
            conn, _ = server.accept()
            with conn:
                conn.recv(1 << 16)  # the request (small: one recv)
                conn.sendall(answer)

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{server.getsockname()[1]}", server


def test_an_engine_whose_error_answer_breaks_off_is_not_counted_in_flight_after():
    """An engine's 500 whose body breaks off fails that request, and the router still counts
    the engine idle: ties between idle engines rotate, so the next two requests reach both."""
    done = {"choices": [{"index": 0, "text": "<7>", "token_ids": [7], "finish_reason": "length"}]}
    ok = json.dumps(done).encode()
    ok_answer = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
    ok_answer = ok_answer % len(ok) + b"Connection: close\r\n\r\n" + ok
    broken = b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 100\r\n\r\nshort"
    first, s1 = raw_engine([broken, ok_answer, ok_answer])
    second, s2 = raw_engine([ok_answer, ok_answer, ok_answer])
    body = {"prompt": PROMPT, "max_tokens": 1, "return_token_ids": True}
    try:
        with TestClient(build_app([first, second]), raise_server_exceptions=False) as client:
            assert client.post("/v1/completions", json=body).status_code >= 500
            assert client.get("/router/stats").json()["requests"] == {first: 1}
            for _ in range(2):
                assert client.post("/v1/completions", json=body).status_code == 200
            assert client.get("/router/stats").json()["requests"] == {first: 2, second: 1}
    finally:
        s1.close()
        s2.close()
