"""Trainer-side control plane for one or more vLLM servers: pause, resume, sleep, wake. Adds to
vLLM's dev-mode routes (``VLLM_SERVER_DEV_MODE=1``) what an RL loop needs: fan-out to every
engine (each must be paused on its own), a ``node_rank`` guard, finite timeouts, and errors that
carry the server's message."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import requests

from vllm_ascend_rl import metrics

PauseMode = Literal["abort", "wait", "keep"]


class EngineControlError(RuntimeError):
    """A control call failed; ``status`` is the HTTP status (``None`` if unreachable)."""

    def __init__(self, url: str, status: int | None, message: str) -> None:
        super().__init__(f"{url}: {status or 'unreachable'}: {message}")
        self.url, self.status, self.message = url, status, message


# The call that takes a control call back, for the all-or-nothing rule of a fan-out.
UNDO = {"/pause": "/resume", "/sleep": "/wake_up"}


class FanOutError(EngineControlError):
    """A control call failed on some engines. ``failures``: failed URL -> its error;
    ``undone``: URL where the call was taken back -> ``None``, or the undo's error."""

    def __init__(
        self,
        route: str,
        failures: dict[str, EngineControlError],
        undo: str | None,
        undone: dict[str, Any],
    ) -> None:
        self.failures = failures
        self.undone = {
            u: (r if isinstance(r, EngineControlError) else None) for u, r in undone.items()
        }
        failed = "; ".join(map(str, failures.values()))
        parts = [f"{route} failed on {len(failures)} engine(s): {failed}"]
        if ok := [u for u, r in self.undone.items() if r is None]:
            parts.append(f"{undo} sent to the engine(s) where it had taken effect: {', '.join(ok)}")
        if bad := [r for r in self.undone.values() if r is not None]:
            parts.append(f"{undo} failed too: " + "; ".join(map(str, bad)))
        RuntimeError.__init__(self, ". ".join(parts))
        first = next(iter(failures.values()))
        self.url, self.status, self.message = first.url, first.status, str(self)


class EnginesDisagree(RuntimeError):
    """Engines behind one client report different states; ``values`` maps URL to state."""

    def __init__(self, what: str, values: dict[str, Any]) -> None:
        listed = ", ".join(f"{u}: {v}" for u, v in values.items())
        super().__init__(f"engines disagree on {what} ({listed})")
        self.what, self.values = what, values


def error_message(response: requests.Response) -> str:
    """The human part of a vLLM error body (``{"error": {"message": ...}}`` or plain text)."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:2000]
    err = body.get("error", body) if isinstance(body, dict) else body
    return str(err.get("message", err) if isinstance(err, dict) else err)


class EngineControlClient:
    """Control one engine (a URL) or several (a list); calls fan out to all of them.
    ``node_rank != 0`` makes every call a no-op returning ``None``: the guard RL frameworks
    need when each node's actor holds a handle to the same server."""

    def __init__(
        self, urls: str | Sequence[str], *, node_rank: int = 0, timeout_s: float = 300.0
    ) -> None:
        self.urls = [u.rstrip("/") for u in ([urls] if isinstance(urls, str) else urls)]
        if not self.urls:
            raise ValueError("EngineControlClient needs at least one server URL")
        self.node_rank = node_rank
        self.timeout_s = timeout_s

    def _call(
        self, url: str, method: str, route: str, params: Any, json: Any, timeout_s: float | None
    ) -> Any:
        try:
            # A fresh connection per call: Starlette closes the connection after an unhandled
            # server error, which would fail the next call on a reused keep-alive socket.
            r = requests.request(
                method, url + route, params=params, json=json, timeout=timeout_s or self.timeout_s
            )
        except requests.RequestException as e:
            raise EngineControlError(url + route, None, str(e)) from e
        if r.status_code >= 400:
            raise EngineControlError(url + route, r.status_code, error_message(r))
        try:
            return r.json()
        except ValueError:
            return r.text

    def _each(self, urls: Sequence[str], *args: Any) -> dict[str, Any]:
        """``{url: _call(url, *args), or the EngineControlError it raised}``, all at once."""

        def one(url: str) -> Any:
            try:
                return self._call(url, *args)
            except EngineControlError as e:
                return e

        with ThreadPoolExecutor(len(urls)) as pool:
            return dict(zip(urls, pool.map(one, urls), strict=True))

    def request(
        self,
        method: str,
        route: str,
        params: Any = None,
        json: Any = None,
        timeout_s: float | None = None,
    ) -> list[Any] | None:
        """Any dev-mode route on every engine, at once (the router's fan-out). All or nothing:
        if any engine fails, those where a ``/pause`` or ``/sleep`` took effect are resumed or
        woken (``UNDO``), and ``FanOutError`` names every failed engine; other routes just
        report the failures."""
        if self.node_rank != 0:
            return None
        args = (method, route, params, json, timeout_s)
        if len(self.urls) == 1:
            return [self._call(self.urls[0], *args)]
        outcomes = self._each(self.urls, *args)
        failed = {u: o for u, o in outcomes.items() if isinstance(o, EngineControlError)}
        if not failed:
            return [outcomes[u] for u in self.urls]
        undo = UNDO.get(route)
        done = [u for u in self.urls if u not in failed]
        undone = self._each(done, "POST", undo, None, None, None) if undo and done else {}
        raise FanOutError(route, failed, undo, undone)

    def agreed(self, values: Iterable[Any], what: str) -> Any:
        """The one value every engine reported; EnginesDisagree if they differ."""
        values = list(values)
        if any(v != values[0] for v in values):
            raise EnginesDisagree(what, dict(zip(self.urls, values, strict=True)))
        return values[0]

    def pause(
        self, mode: PauseMode = "keep", clear_cache: bool = True, timeout_s: float | None = None
    ) -> None:
        """``POST /pause``; returns once every engine's pause is complete. ``keep`` with
        ``clear_cache=True`` (vLLM's default) preempts running requests so they recompute with
        the weights loaded at resume; ``clear_cache=False`` keeps their (then stale) KV cache.
        A completed pause counts in :mod:`vllm_ascend_rl.metrics` (``pause_seconds``)."""
        started = time.perf_counter()
        params = {"mode": mode, "clear_cache": str(clear_cache).lower()}
        self.request("POST", "/pause", params, timeout_s=timeout_s)
        metrics.record({"pauses": 1, "pause_seconds": time.perf_counter() - started}, mode=mode)

    def resume(self) -> None:
        self.request("POST", "/resume")

    def is_paused(self) -> bool | None:
        out = self.request("GET", "/is_paused")
        return None if out is None else self.agreed((o["is_paused"] for o in out), "is_paused")

    def sleep(self, level: int = 1, mode: PauseMode = "abort") -> None:
        self.request("POST", "/sleep", {"level": level, "mode": mode})

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        self.request("POST", "/wake_up", [("tags", t) for t in tags] if tags else None)

    def is_sleeping(self) -> bool | None:
        out = self.request("GET", "/is_sleeping")
        return None if out is None else self.agreed((o["is_sleeping"] for o in out), "is_sleeping")

    # -- weight checks (vLLM >= 0.32's /weight_checker) ---------------------------------
    def weight_checksums(self) -> dict[str, str] | None:
        """SHA-256 of every weight tensor, keyed ``dp0:pp0:pcp0:tp0:<parameter>``, as the
        engines' workers hold them. Engines holding different weights disagree."""
        out = self.request("POST", "/weight_checker", json={"action": "checksum"})
        return None if out is None else self.agreed((o["checksums"] for o in out), "weights")

    def weight_mismatches(self, baseline: dict[str, str]) -> list[str]:
        """Tensors whose digest differs from ``baseline`` on any engine; empty when all match."""
        out = self.request(
            "POST", "/weight_checker", json={"action": "compare", "baseline": baseline}
        )
        return sorted({name for o in out or () for name in o["mismatches"]})

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> None:
        params = {"reset_running_requests": str(reset_running_requests).lower()}
        self.request("POST", "/reset_prefix_cache", params)

    def reload_weights(self, weights_path: str) -> None:
        """Reload the weights from a checkpoint on the server's disk (vLLM's layerwise reload)."""
        self.collective_rpc("reload_weights", weights_path=str(weights_path))

    def collective_rpc(self, method: str, **kwargs: str) -> list[Any] | None:
        """``method`` on every worker of every engine (``/collective_rpc``); results per engine."""
        out = self.request("POST", "/collective_rpc", json={"method": method, "kwargs": kwargs})
        return (
            None if out is None else [o.get("results") if isinstance(o, dict) else o for o in out]
        )

    def world_size(self) -> int | None:
        out = self.request("GET", "/get_world_size")
        return None if out is None else self.agreed((o["world_size"] for o in out), "world_size")
