"""The address-ledger check the e2e suites make after every operation on an engine."""

from __future__ import annotations

from vllm_ascend_rl.client import EngineControlClient


def assert_addresses_kept(url: str, after: str) -> None:
    """Every parameter, buffer, derived tensor and KV cache tensor of every worker is where
    the engine started with it (``moved_addresses`` over ``/collective_rpc``)."""
    engines = EngineControlClient(url, timeout_s=120).collective_rpc("moved_addresses")
    assert engines, f"{url} answered no /collective_rpc"
    moved = {name: ptrs for workers in engines for w in workers for name, ptrs in w.items()}
    shown = dict(sorted(moved.items())[:6])
    assert not moved, f"after {after}: {len(moved)} tensor(s) moved, e.g. {shown}"
