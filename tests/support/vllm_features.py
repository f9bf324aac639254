"""What the vLLM releases under test (0.30 and 0.32, and the canary's newest) serve, detected
by feature, never by version: tests skip or branch on these. The package's own differences are in
:mod:`vllm_ascend_rl.compat`."""

from __future__ import annotations


def has_route(path: str) -> bool:
    """Whether this vLLM's OpenAI server defines ``path`` (dev-mode routes included)."""
    import importlib
    import pkgutil

    import vllm.entrypoints as entrypoints

    for info in pkgutil.walk_packages(entrypoints.__path__, "vllm.entrypoints."):
        if not info.name.endswith("api_router"):
            continue
        try:
            module = importlib.import_module(info.name)
        except Exception:  # optional dependencies of unrelated routers
            continue
        router = getattr(module, "router", None)
        if any(getattr(r, "path", None) == path for r in getattr(router, "routes", ())):
            return True
    return False


def scale_out_flags() -> list[str]:
    """Server flags that expose ``/inference/v1/generate``: ``--enable-scale-out`` where the
    frontend has that option, none where the route is always on."""
    import dataclasses
    import importlib

    try:
        cli_args = importlib.import_module("vllm.entrypoints.launchers.cli_args")
    except ImportError:
        return []
    options = {
        f.name
        for obj in vars(cli_args).values()
        if isinstance(obj, type) and dataclasses.is_dataclass(obj)
        for f in dataclasses.fields(obj)
    }
    return ["--enable-scale-out"] if "enable_scale_out" in options else []


def sleep_route_validates_level() -> bool:
    """Whether vLLM's ``/sleep`` route declares ``level`` as a validated query parameter."""
    import inspect

    from vllm.entrypoints.serve.dev.sleep import api_router

    route = next(r for r in api_router.router.routes if getattr(r, "path", None) == "/sleep")
    return "level" in inspect.signature(route.endpoint).parameters


def has_weight_version_spans() -> bool:
    """Whether generate outputs say which weight version produced which tokens."""
    from vllm.entrypoints.scale_out.token_in_token_out import protocol

    return hasattr(protocol, "WeightVersionSpan")


def runner_output_takes_index() -> bool:
    """Whether vLLM's ``ModelRunnerOutput`` takes ``req_id_to_index`` (gone in 0.34)."""
    import dataclasses

    from vllm.v1.outputs import ModelRunnerOutput

    return "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}
