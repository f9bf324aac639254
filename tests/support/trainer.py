"""A stand-in trainer in its own process, driven by tests, examples and benchmarks.

It holds a Hugging Face model (the "policy"), loads new checkpoints into it (the "training
step"), and pushes its weights into a vLLM server through the public trainer API:
``vllm_ascend_rl.register()``, ``WeightTransferTrainerFactory.trainer_init(...)``,
``engine.send_weights()``. Commands and replies travel over pipes; its output goes to its log.
It can also misbehave on purpose (wrong metadata, dying mid-transfer) to exercise the engine's
error paths.

    with TrainerProcess(v2_path) as trainer:
        trainer.init("ascend_rl_hccl", server.url, world_size=2)
        result = trainer.send(weight_version="v2")
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.connection
import multiprocessing.context
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

# Imported once in a fork server (CPU): each trainer is forked from it instead of importing
# torch and vLLM again (13 s of CPU per trainer on the CI host).
PRELOAD = [
    "torch",
    "safetensors.torch",
    "tests.support.tiny_model",
    "vllm.distributed.weight_transfer",
    "vllm_ascend_rl.weight_transfer.hccl_trainer",
    "vllm_ascend_rl.weight_transfer.npu_ipc_trainer",
]


def _context() -> multiprocessing.context.BaseContext:
    """A fork server on CPU; on NPU a fresh interpreter per trainer (nothing may initialise
    the device before a fork, and vLLM's platform detection would import torch_npu)."""
    if os.environ.get("VLLM_ASCEND_RL_DEVICE") == "npu":
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class TrainerError(RuntimeError):
    """The trainer process reported an error (its message is the engine's or its own)."""


class TrainerProcess:
    """Client for a trainer process (:func:`_serve`), commands and replies over pipes."""

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        env: dict[str, str] | None = None,
        log_path: str | os.PathLike | None = None,
    ) -> None:
        self.model_path = str(model_path)
        self.last_url: str | None = None
        ctx = _context()
        commands, self._commands = ctx.Pipe(duplex=False)
        self._replies_in, replies = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(
            target=_child,
            args=(self.model_path, env or {}, str(log_path or os.devnull), commands, replies),
            name="trainer",
        )
        self.proc.start()
        commands.close()  # the child holds them now: its exit is our EOF
        replies.close()
        self._replies: list[dict] = []
        self._eof = False
        self._cv = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.request("ping", timeout_s=300)

    def _read(self) -> None:
        while True:
            try:
                reply = self._replies_in.recv()
            except (EOFError, OSError):  # the process is exiting
                break
            with self._cv:
                self._replies.append(reply)
                self._cv.notify_all()
        with self._cv:
            self._eof = True
            self._cv.notify_all()

    def request(self, cmd: str, timeout_s: float = 600, **args: Any) -> Any:
        """Send one command and wait for its reply; TrainerError if it failed."""
        try:
            self._commands.send({"cmd": cmd, **args})
        except OSError:  # it died; the wait below reports how
            pass
        with self._cv:
            if not self._cv.wait_for(lambda: self._replies or self._eof, timeout_s):
                raise TimeoutError(f"trainer command {cmd!r} timed out after {timeout_s}s")
            if not self._replies:
                self.proc.join(10)  # only this thread joins: the sentinel has one reader
                raise TrainerError(
                    f"trainer process exited with code {self.proc.exitcode} during {cmd!r}"
                )
            reply = self._replies.pop(0)
        if not reply["ok"]:
            raise TrainerError(reply["error"])
        return reply.get("result")

    def init(self, backend: str, url: str, **init_info: Any) -> None:
        """``trainer_init`` for the engine at ``url``. One trainer may feed several engines
        (an external load balancer): each has its own connection, kept by URL."""
        self.request("init", backend=backend, url=url, init_info=init_info)
        self.last_url = url

    def release(self, url: str) -> None:
        """Shut down this trainer's engine for ``url``: the engine's weight channel is free
        for another trainer."""
        self.request("release", url=url)

    def join_ranks(self, master_port: int, rank: int, world_size: int) -> None:
        """Form torch.distributed's default (gloo) group with the other trainer processes,
        as a multi-rank trainer has one."""
        self.request("dist_init", port=master_port, rank=rank, world_size=world_size)

    def send(
        self,
        weight_version: str | None = None,
        *,
        url: str | None = None,
        pause: bool = True,
        draft: bool = False,
        **faults: Any,
    ) -> dict:
        """Sync the engine at ``url`` (default: the one initialized last); ``draft``: its
        drafter, from the checkpoint :meth:`load_draft` loaded. ``pause``: an engine that is
        not paused is paused (``keep``) for the sync and resumed after, as an RL loop does;
        ``pause=False`` syncs it while it generates."""
        from vllm_ascend_rl.client import EngineControlClient, EngineControlError

        target = url or self.last_url
        pause = pause and target is not None
        ctl = EngineControlClient(target, timeout_s=60) if pause else None
        try:
            paused_here = ctl is not None and ctl.is_paused() is False
        except EngineControlError:  # the engine is gone: the sync reports it
            paused_here = False
        if paused_here:
            ctl.pause(mode="keep")
        try:
            args = {"weight_version": weight_version, "url": url, "draft": draft}
            return self.request("send", faults=faults, **args)
        finally:
            if paused_here:
                try:
                    ctl.resume()
                except EngineControlError:  # the sync killed or hung it: the test checks
                    pass

    def load(self, checkpoint: str | os.PathLike) -> None:
        self.request("load", path=str(checkpoint))

    def load_draft(self, checkpoint: str | os.PathLike) -> None:
        """The drafter's weights :meth:`send` sends with ``draft=True``."""
        self.request("load_draft", path=str(checkpoint))

    def metrics(self) -> str:
        """The trainer process's counters in Prometheus text form (metrics.py)."""
        return self.request("metrics")

    def registered_engines(self) -> dict[str, list[str]]:
        """The names in vLLM's weight-transfer factories of this process, which ran every
        general plugin as a vLLM process does: ``{"engine": [...], "trainer": [...]}``."""
        return self.request("registered_engines")

    def wait_exit(self, timeout_s: float = 60) -> int:
        self.proc.join(timeout_s)
        if self.proc.exitcode is None:
            raise TimeoutError(f"the trainer process did not exit within {timeout_s}s")
        return self.proc.exitcode

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.request("exit", timeout_s=30)
            except Exception:
                pass
            self.proc.join(30)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(30)
        self._commands.close()
        self._replies_in.close()

    def __enter__(self) -> TrainerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------------------
# The trainer process itself.


def _faulty_source(model, faults: dict):
    """A ModuleSource that lies about or breaks its weights, for error-path tests, or
    leaves the modules named by a prefix in ``freeze`` out."""
    import torch
    from vllm.distributed.weight_transfer import ModuleSource
    from vllm.distributed.weight_transfer.base import ParamMeta

    class FaultySource(ModuleSource):
        def _pairs(self) -> Iterator[tuple[str, torch.Tensor]]:
            for name, t in super().__iter__():
                if name.startswith(tuple(faults.get("freeze", ()))):
                    continue  # a frozen module: not sent (a partial update)
                if faults.get("rename") == name:
                    name = name + "_unknown"
                if faults.get("grow") == name:
                    t = torch.cat([t, t[: faults.get("grow_rows", 64)]])
                if faults.get("dtype") and faults.get("dtype_param") == name:
                    t = t.to(getattr(torch, faults["dtype"]))
                yield name, t

        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self._pairs()]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            for i, pair in enumerate(self._pairs()):
                if i == faults.get("die_after_tensors"):
                    os._exit(17)  # a trainer crash mid-transfer
                if i == faults.get("stall_after_tensors"):
                    time.sleep(faults["stall_s"])  # a trainer that hangs mid-transfer
                yield pair

    return FaultySource(model)


def _foreign_after(client, call: str, answers: list[list]) -> None:
    """After the trainer's ``call`` returns, a hand-written ``/update_weights`` (no trainer
    named) reaches the engine; its HTTP status and text go to ``answers``."""
    import requests

    real = getattr(client, call)

    def then_foreign(*args, **kwargs):
        out = real(*args, **kwargs)
        body = {"names": ["model.norm.weight"], "dtype_names": ["bfloat16"], "shapes": [[128]]}
        r = requests.post(f"{client.base_url}/update_weights", json={"update_info": body})
        answers.append([r.status_code, r.text])
        return out

    setattr(client, call, then_foreign)


def _patch_payload(engine, patch: dict) -> None:
    """Overwrite fields of the next update_weights payload (e.g. a corrupt IPC handle)."""
    original = engine.payload

    def patched(specs, plan):
        payload = original(specs, plan)
        payload.update(patch)
        return payload

    engine.payload = patched


def _child(
    model_path: str,
    env: dict[str, str],
    log_path: str,
    commands: multiprocessing.connection.Connection,
    replies: multiprocessing.connection.Connection,
) -> None:
    """The trainer process: its environment and log, then :func:`_serve` until told to exit
    or its client is gone, then the exit handlers (multiprocessing skips them)."""
    from multiprocessing import resource_tracker

    os.environ.update(env)
    sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    # Its own resource tracker, as a trainer has: a fork server's children share the test
    # process's, which would unlink a dead trainer's segments only when the tests end.
    tracker = resource_tracker._resource_tracker
    if tracker._fd is not None:
        os.close(tracker._fd)
        tracker._fd = tracker._pid = None
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.dup2(log, 1)
    os.dup2(log, 2)
    try:
        _serve(model_path, commands, replies)
    finally:
        atexit._run_exitfuncs()


def _serve(
    model_path: str,
    commands: multiprocessing.connection.Connection,
    replies: multiprocessing.connection.Connection,
) -> None:
    import torch
    from safetensors.torch import load_file
    from vllm.distributed.weight_transfer import (
        HTTPVLLMWeightSyncClient,
        ModuleSource,
        WeightTransferTrainerFactory,
    )

    import vllm_ascend_rl
    from tests.support.tiny_model import load_hf_model

    vllm_ascend_rl.register()
    # A trainer that embeds vLLM (an in-process engine, Ray) also runs every general plugin.
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from vllm_ascend_rl.device import current_device

    model = load_hf_model(model_path).to(current_device().torch_device())
    draft = None  # the drafter's weights (load_draft)
    engines: dict[str, Any] = {}  # one trainer-side engine per server URL
    last_url: str | None = None

    def reply(ok: bool, result: Any = None, error: str | None = None) -> None:
        replies.send({"ok": ok, "result": result, "error": error})

    while True:
        try:
            msg = commands.recv()
        except EOFError:  # the client is gone
            return
        cmd = msg["cmd"]
        try:
            if cmd == "ping":
                from vllm_ascend_rl.weight_transfer.wire import trainer_id

                reply(True, {"pid": os.getpid(), "trainer_id": trainer_id()})
            elif cmd == "metrics":  # the trainer's counters, as a user's registry shows them
                from prometheus_client import CollectorRegistry, generate_latest

                from vllm_ascend_rl.metrics import register_trainer_metrics

                registry = CollectorRegistry()
                register_trainer_metrics(registry)
                reply(True, generate_latest(registry).decode())
            elif cmd == "exit":
                for engine in engines.values():
                    engine.shutdown()
                reply(True)
                return
            elif cmd == "release":
                if msg["url"] in engines:
                    engines.pop(msg["url"]).shutdown()
                reply(True)
            elif cmd == "dist_init":
                import torch.distributed as dist

                dist.init_process_group(
                    "gloo",
                    init_method=f"tcp://127.0.0.1:{msg['port']}",
                    rank=msg["rank"],
                    world_size=msg["world_size"],
                )
                reply(True)
            elif cmd == "load":
                with torch.no_grad():
                    model.load_state_dict(
                        load_file(os.path.join(msg["path"], "model.safetensors")), strict=True
                    )
                reply(True)
            elif cmd == "load_draft":
                draft = load_hf_model(msg["path"]).to(current_device().torch_device())
                reply(True)
            elif cmd == "registered_engines":
                from vllm.distributed.weight_transfer.factory import (
                    WeightTransferEngineFactory,
                    WeightTransferTrainerFactory,
                )

                reply(
                    True,
                    {
                        "engine": sorted(WeightTransferEngineFactory._registry),
                        "trainer": sorted(WeightTransferTrainerFactory._registry),
                    },
                )
            elif cmd == "init":
                if msg["url"] in engines:
                    engines.pop(msg["url"]).shutdown()
                fields = dict(msg["init_info"])
                if fields.pop("die_during_init", False):
                    _die_during_init()
                info = _init_info(msg["backend"], fields)
                engines[msg["url"]] = WeightTransferTrainerFactory.trainer_init(
                    info,
                    client=HTTPVLLMWeightSyncClient(msg["url"], timeout=600),
                    source=ModuleSource(model),
                )
                last_url = msg["url"]
                reply(True)
            elif cmd == "send":
                engine = engines.get(msg.get("url") or last_url or "")
                if engine is None:
                    raise RuntimeError(f"send before init (engine {msg.get('url')})")
                faults = dict(msg.get("faults") or {})
                payload_patch = faults.pop("payload", None)
                if faults.pop("die_before_finish", False):  # every weight sent, never finished
                    engine.client.finish_weight_update = lambda *_: os._exit(17)
                foreign: list[list] = []
                if "foreign_after" in faults:  # a hand-written update lands in this window
                    _foreign_after(engine.client, faults.pop("foreign_after"), foreign)
                weights = draft if msg.get("draft") else model
                source = _faulty_source(weights, faults) if faults else ModuleSource(weights)
                if payload_patch:
                    _patch_payload(engine, payload_patch)
                try:
                    version = msg.get("weight_version")
                    r = engine.send_weights(version, source=source, draft=bool(msg.get("draft")))
                finally:
                    engine.__dict__.pop("payload", None)
                    for call in ("start_weight_update", "update_weights"):
                        engine.client.__dict__.pop(call, None)  # its class's methods again
                reply(
                    True,
                    {
                        "bytes": r.bytes,
                        "seconds": r.seconds,
                        "gbps": r.gbps,
                        "num_tensors": r.num_tensors,
                        "num_buckets": r.num_buckets,
                        "foreign": foreign,
                    },
                )
            else:
                raise ValueError(f"unknown command {cmd!r}")
        except Exception as e:
            reply(False, error=f"{type(e).__name__}: {e}")


def _die_during_init() -> None:
    """Crash once the engine workers have joined the init but before it completes: HCCL,
    after the rendezvous and before the init handshake; NPU IPC, when a worker says hello."""
    from vllm_ascend_rl.weight_transfer import npu_ipc_trainer
    from vllm_ascend_rl.weight_transfer.channel import BroadcastChannel

    def die(*_: Any, **__: Any) -> None:
        os._exit(17)

    BroadcastChannel.agree = die
    npu_ipc_trainer.welcome = die


def _init_info(backend: str, fields: dict):
    if backend == "ascend_rl_hccl":
        from vllm_ascend_rl.weight_transfer.hccl import HCCLTrainerInitInfo

        return HCCLTrainerInitInfo(**{"rank": 0, **fields})
    if backend == "ascend_rl_npu_ipc":
        from vllm_ascend_rl.weight_transfer.npu_ipc import NPUIPCTrainerInitInfo

        return NPUIPCTrainerInitInfo(**{"rank": 0, **fields})
    raise ValueError(f"unknown backend {backend!r}")
