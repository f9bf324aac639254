"""The doctor's checks of running servers, over HTTP only (``--engine URL``): reachable, the
dev-mode routes, paused and asleep, world size, the configuration the server reports
(``/server_info``), ``/weight_checker``; several servers are compared with each other."""

from __future__ import annotations

from typing import Any

import requests

from vllm_ascend_rl.doctor import Check, fail, ok, ok_or_fail, warn

SCHEDULER = "vllm_ascend_rl.core.recompute_scheduler.AsyncRecomputeScheduler"
OUR_SCHEDULERS = ("AsyncRecomputeScheduler", "RecomputeScheduler")


def checks(urls: list[str], timeout_s: float) -> list[Check]:
    out: list[Check] = []
    facts: dict[str, dict[str, Any]] = {}
    for url in urls:
        facts[url], checked = engine(url.rstrip("/"), timeout_s)
        out += checked
    return out + compare(facts) if len(urls) > 1 else out


def _get(url: str, path: str, timeout_s: float, **params: str) -> requests.Response:
    return requests.get(url + path, params=params, timeout=timeout_s)


def engine(url: str, timeout_s: float) -> tuple[dict[str, Any], list[Check]]:
    """This server's checks, and the facts :func:`compare` needs ({} if unreachable)."""
    area = f"engine {url}"
    try:
        health = _get(url, "/health", timeout_s)
    except requests.RequestException as e:
        fix = "start the server, or pass the URL it listens on"
        return {}, [fail(area, "reachable", f"{type(e).__name__}: {e}", fix)]
    if health.status_code != 200:
        fix = "see the server's log: it is starting, or its engine died"
        return {}, [fail(area, "reachable", f"/health answered HTTP {health.status_code}", fix)]
    out = [ok(area, "reachable", "/health 200")]
    try:  # a dropped connection or an unexpected answer fails "answers"
        models = _get(url, "/v1/models", timeout_s).json().get("data") or [{}]
        facts: dict[str, Any] = {"model": models[0].get("root") or models[0].get("id")}
        paused = _get(url, "/is_paused", timeout_s)
        if paused.status_code == 404:
            fix = "restart the server with VLLM_SERVER_DEV_MODE=1 (the RL loop's routes need it)"
            return facts, [*out, fail(area, "dev mode", "/is_paused: HTTP 404", fix)]
        out.append(ok(area, "dev mode", "the RL routes answer"))
        state = "paused" if paused.json().get("is_paused") else "generating"
        asleep = _get(url, "/is_sleeping", timeout_s).json().get("is_sleeping")
        out.append(ok(area, "state", f"{state}, {'asleep' if asleep else 'awake'}"))
        size = _get(url, "/get_world_size", timeout_s, include_dp="true")
        if size.status_code == 200:
            facts["world_size"] = size.json()["world_size"]
            out.append(ok(area, "world size", f"{facts['world_size']} engine worker(s)"))
        else:
            fix = "this vLLM has no /get_world_size: use vLLM 0.30.0 or 0.32.0"
            found = f"/get_world_size: HTTP {size.status_code}"
            out.append(fail(area, "world size", found, fix))
        info = _get(url, "/server_info", timeout_s, config_format="json")
        config = info.json().get("vllm_config") if info.status_code == 200 else None
        out += configuration(area, config if isinstance(config, dict) else None)
        # A POST route answers GET with 405; absent: 404.
        present = _get(url, "/weight_checker", timeout_s).status_code == 405
        out.append(ok(area, "/weight_checker", "present" if present else "absent (vLLM < 0.32)"))
        out.append(addresses(url, area, timeout_s))
        return facts, out
    except (requests.RequestException, ValueError, KeyError) as e:
        fix = "check that the URL is a vLLM server of a supported stack (vLLM 0.30.0 or 0.32.0)"
        return {}, [*out, fail(area, "answers", f"{type(e).__name__}: {e}", fix)]


def addresses(url: str, area: str, timeout_s: float) -> Check:
    """The workers' address ledgers: a tensor that moved since start-up is one a captured
    graph no longer reads (docs/sleep-mode.md#addresses)."""
    rpc = {"method": "moved_addresses"}
    r = requests.post(url + "/collective_rpc", json=rpc, timeout=timeout_s)
    if r.status_code != 200:
        fix = "run the plugin's worker, or --worker-extension-cls "
        fix += "vllm_ascend_rl.worker.ledger.AddressLedger"
        return warn(area, "addresses", f"no address ledger (HTTP {r.status_code})", fix)
    moved = {name for worker in r.json()["results"] for name in worker}
    if moved:
        fix = "restart the engine (graphs replay stale memory) and report the operation before"
        return fail(area, "addresses", f"moved since start-up: {sorted(moved)[:5]}", fix)
    return ok(area, "addresses", "every tensor where the engine started it")


def configuration(area: str, config: dict[str, Any] | None) -> list[Check]:
    if config is None:
        return [warn(area, "configuration", "/server_info gave no JSON config", "")]
    # Not at the top: _registration's logger imports vLLM, whose log handler binds the stdout of
    # that moment; the doctor's --json output must stay alone on stdout (cli.py redirects it).
    from vllm_ascend_rl._registration import HCCL_BACKEND, NPU_IPC_BACKEND

    backend = (config.get("weight_transfer_config") or {}).get("backend")
    if backend in (HCCL_BACKEND, NPU_IPC_BACKEND):
        transfer = ok(area, "weight transfer", str(backend))
    else:
        fix = f"""restart with --weight-transfer-config '{{"backend": "{HCCL_BACKEND}"}}' """
        fix += f"(or {NPU_IPC_BACKEND} for a colocated trainer)"
        transfer = fail(area, "weight transfer", f"backend {backend!r}, not the plugin's", fix)
    scheduler = str((config.get("scheduler_config") or {}).get("scheduler_cls"))
    ours = scheduler.rsplit(".", 1)[-1].strip("'>") in OUR_SCHEDULERS
    fix = f"restart with --scheduler-cls {SCHEDULER} (pause/resume checks, on_failure=hold)"
    return [transfer, ok_or_fail(area, "scheduler", ours, scheduler, fix)]


def compare(facts: dict[str, dict[str, Any]]) -> list[Check]:
    """Engines one trainer syncs must serve the same model on the same world size."""
    out = []
    for key, fix in (
        ("model", "start every engine on the same model"),
        ("world_size", "give every engine the same TP x PP x DP (one trainer group each)"),
    ):
        seen = {url: f[key] for url, f in facts.items() if key in f}
        found = ", ".join(f"{url}: {v}" for url, v in seen.items())
        out.append(ok_or_fail("engines", f"same {key}", len(set(seen.values())) < 2, found, fix))
    return out
