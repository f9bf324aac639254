"""Fixtures and options shared by unit and end-to-end tests.

``--device npu`` (or ``VLLM_ASCEND_RL_DEVICE=npu``) is the one switch that makes the e2e suites
start NPU servers and trainers: it is exported to every process the tests start. ``make
test-npu`` runs ``-m ascend`` (every test that runs on NPUs) that way on an Ascend host.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from examples.plumbing.server import is_vllm_segment, shm_mapped_by
from tests.support import (
    TinyModelSpec,
    VLLMServer,
    build_model_pair,
    build_tiny_model,
    engine_args,
    rl_engine_args,
)
from tests.support.profile import current_profile
from tests.support.server_plan import ServerPlan
from tests.support.shared_servers import GRAPHS_BACKEND, RL_BACKENDS, SHARED, SharedServers
from tests.support.standin_vllm_ascend import install_standin, real_vllm_ascend_installed
from tests.support.vllm_features import scale_out_flags


def pytest_addoption(parser):
    parser.addoption(
        "--device",
        choices=("cpu", "npu"),
        default=os.environ.get("VLLM_ASCEND_RL_DEVICE", "cpu"),
        help="device the suites run on (exported as VLLM_ASCEND_RL_DEVICE)",
    )
    parser.addoption(
        "--no-prefetch",
        action="store_true",
        help="start each module's servers when it starts, as on NPU (to see NPU's chip layout)",
    )


CANARY = os.environ.get("VLLM_ASCEND_RL_CANARY") == "1"  # `make canary`: the newest vLLM's sources


def pytest_configure(config):
    os.environ["VLLM_ASCEND_RL_DEVICE"] = config.getoption("--device")
    if CANARY:
        fake_triton_for_cpu_configs()


def fake_triton_for_cpu_configs() -> None:
    """The canary's one fake: vLLM 0.34's x86 CPU platform refuses every config without
    Triton-CPU (``platforms/cpu.py``, ``check_and_update_config``), which no index serves here;
    Triton is said to be there during that check only."""
    import vllm.triton_utils
    from vllm.platforms.cpu import CpuPlatform

    check = CpuPlatform.check_and_update_config.__func__

    def with_triton(cls, vllm_config):
        vllm.triton_utils.HAS_TRITON = True
        try:
            return check(cls, vllm_config)
        finally:
            vllm.triton_utils.HAS_TRITON = False

    CpuPlatform.check_and_update_config = classmethod(with_triton)


REPORT = pytest.StashKey[list]()


@pytest.fixture
def report(request) -> Callable[[str], None]:
    """Add a line to the session's closing summary, which CI's log shows."""
    return request.config.stash.setdefault(REPORT, []).append


def pytest_terminal_summary(terminalreporter, config):
    """The lines tests reported, and how full the chips got (docs/deployment.md quotes it)."""
    from examples.plumbing.profile import layout_report

    for line in [*config.stash.get(REPORT, []), layout_report()]:
        if line:
            terminalreporter.write_line(line)


def pytest_collection_modifyitems(config, items):
    on_npu = config.getoption("--device") == "npu"
    need_npu = pytest.mark.skip(reason="needs Ascend NPUs: make test-npu on an Ascend host")
    need_cpu = pytest.mark.skip(reason="exercises a CPU stand-in of the hardware")
    # Last, so that no other test waits for a killed shared server to start again.
    items.sort(key=lambda item: item.get_closest_marker("kills_shared_servers") is not None)
    for item in items:
        if item.get_closest_marker("npu_only") and not on_npu:
            item.add_marker(need_npu)
        if item.get_closest_marker("cpu_only") and on_npu:
            item.add_marker(need_cpu)


@pytest.fixture(scope="session")
def tiny_model():
    """The default tiny checkpoint ("v1" weights, seed 1)."""
    return build_tiny_model(TinyModelSpec(seed=1))


@pytest.fixture(scope="session")
def model_pair():
    """(v1, v2): ``tiny_model`` and the same shape with other weights (seed 2)."""
    return build_model_pair()


@pytest.fixture(scope="session")
def standin_env(tmp_path_factory) -> dict[str, str]:
    """Environment that puts vllm-ascend's registrations (engines ``hccl``, ``npu_ipc``, made
    without a guard) beside ours in every process that runs general plugins: on an Ascend
    host the real vllm-ascend is there already; elsewhere a stand-in is discovered first (it
    also registers trainers ``npu_ipc`` and ``hccl``) and appends its pid to STANDIN_MARKER."""
    if real_vllm_ascend_installed():
        return {}  # the real plugin is the test; a stand-in would register its names twice
    root = tmp_path_factory.mktemp("standin")
    path = install_standin(root / "site")
    return {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(path), os.environ.get("PYTHONPATH")])),
        "STANDIN_MARKER": str(root / "pids"),
    }


@pytest.fixture(scope="session")
def shared_servers(request, tmp_path_factory, model_pair, standin_env):
    """The session's shared servers (tests/support/shared_servers.py):

    - ``reference-v1``, ``reference-v2``: vLLM's own engine on v1 / v2, the greedy references
      (v1 also the upstream side of the pause matrix, the bounce target, and, with the
      plugin's HCCL engine, an RL engine whose scheduler has no step gate);
    - ``rl-<backend>`` per weight-transfer backend: an RL engine on v1 with the plugin
      scheduler, the sleepable worker (with vllm-ascend's ``NPUWorker`` weight-update
      lifecycle), prefix caching, ``/inference/v1/generate`` and ``UpdateFaults``, beside
      vllm-ascend's registrations; the ``GRAPHS_BACKEND`` one in vLLM's default compile mode
      (ACL graphs on Ascend), with ``reference-v2-graphs``, v2 in that mode."""
    v1, v2 = model_pair
    prefix = ["--enable-prefix-caching", "--enable-prompt-tokens-details"]
    rl_flags = [*scale_out_flags(), *prefix]
    faults = ["--worker-extension-cls", "tests.support.update_faults.UpdateFaults"]

    hccl = ["--weight-transfer-config", '{"backend": "ascend_rl_hccl"}']

    def reference(model, args):
        return lambda log: VLLMServer(model, log_path=log, extra_args=args)

    def rl_engine(backend):
        graphs = backend == GRAPHS_BACKEND
        args = [*rl_engine_args(backend, sleepable=True, graphs=graphs), *rl_flags, *faults]
        return lambda log: VLLMServer(v1, env=standin_env, log_path=log, extra_args=args)

    makers = {
        "reference-v1": reference(v1, [*engine_args(), *prefix, *hccl]),
        "reference-v2": reference(v2, engine_args()),
        "reference-v2-graphs": reference(v2, engine_args(graphs=True)),
        **{f"rl-{backend}": rl_engine(backend) for backend in RL_BACKENDS},
    }
    assert set(makers) == set(SHARED), "tests/support/shared_servers.py lists them for the layout"
    with_graphs = request.config.stash.get(USES_GRAPHS, False)
    shared = SharedServers(tmp_path_factory.mktemp("shared-servers"), makers, with_graphs)
    yield shared
    shared.close()


@pytest.fixture(scope="session")
def rl_engines(shared_servers) -> Callable[[str], VLLMServer]:
    """``rl_engines(backend)``: the session's RL engine for that backend. Users leave it
    resumed, awake and on v1; one killed by a test is started again."""
    return lambda backend: shared_servers.get(f"rl-{backend}")


SERVER_ORDER = pytest.StashKey[list]()
USES_GRAPHS = pytest.StashKey[bool]()


def pytest_collection_finish(session):
    """The module servers (each module's ``SERVERS``) in the order the tests need them, and
    whether a module uses the shared compile-mode pair (``USES_COMPILE_MODE_PAIR``)."""
    order: list = []
    modules = {getattr(item, "module", None) for item in session.items}
    for item in session.items:
        for make in getattr(getattr(item, "module", None), "SERVERS", ()):
            if make not in order:
                order.append(make)
    session.config.stash[SERVER_ORDER] = order
    session.config.stash[USES_GRAPHS] = any(
        getattr(m, "USES_COMPILE_MODE_PAIR", False) for m in modules
    )


@pytest.fixture(scope="session")
def server_plan(request, tmp_path_factory) -> ServerPlan:
    """Module servers, each started while the module before it runs (CPU hosts only: on NPU
    a server starting early would hold chips and device memory)."""
    order = request.config.stash.get(SERVER_ORDER, [])
    prefetch = current_profile().kind == "cpu" and not request.config.getoption("--no-prefetch")
    plan = ServerPlan(tmp_path_factory.mktemp("module-servers"), order, prefetch)
    yield plan
    plan.close()


@pytest.fixture(scope="session")
def reference_v1(shared_servers) -> VLLMServer:
    return shared_servers.get("reference-v1")


@pytest.fixture(scope="session")
def reference_v2(shared_servers) -> VLLMServer:
    return shared_servers.get("reference-v2")


@pytest.fixture(scope="session")
def references_v2(shared_servers) -> Callable[[str], VLLMServer]:
    """``references_v2(backend)``: the greedy reference on v2 for that backend's RL engine
    (in compile mode for ``GRAPHS_BACKEND``'s)."""
    graphs = {GRAPHS_BACKEND: "reference-v2-graphs"}
    return lambda backend: shared_servers.get(graphs.get(backend, "reference-v2"))


SHM = Path("/dev/shm")
BESIDE_SERVERS = "VLLM_ASCEND_RL_BESIDE_SERVERS"
OUR_PREFIX = "vllm_ascend_rl_"  # the trainers' staging segments


def new_segments(before: set[str]) -> set[str]:
    """Segments (vLLM's, its locks, ours) in /dev/shm that are not in ``before``."""
    return {
        p.name
        for p in SHM.iterdir()
        if p.name not in before and (is_vllm_segment(p.name) or p.name.startswith(OUR_PREFIX))
    }


def mapped_segments() -> set[str]:
    """Names of the /dev/shm segments some live process maps."""
    return set().union(*(shm_mapped_by(pid) for pid in psutil.pids()))


UNMAPPED_AFTER: dict[str, str] = {}  # segment -> the first module after which no process mapped it


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_left_behind():
    """Every server, trainer and engine the suite starts must give its /dev/shm back: a
    leaked vLLM segment holds hundreds of MiB of RAM until reboot. A session run beside the
    one with servers (``make test``: BESIDE_SERVERS) leaves the check to it, which spans it:
    /dev/shm is one namespace, and a running server's segments are not this session's."""
    if not SHM.is_dir() or os.environ.get(BESIDE_SERVERS) == "1":
        yield
        return
    before = {p.name for p in SHM.iterdir()}
    yield
    leaked = {name: UNMAPPED_AFTER.get(name, "?") for name in sorted(new_segments(before))}
    assert not leaked, f"the test session left shared memory behind (unmapped after): {leaked}"


@pytest.fixture(scope="module", autouse=True)
def note_unmapped_segments(request):
    """Names the module a leak comes from. Only the session check fails: a Python resource
    tracker may still unlink an unmapped segment (a killed process's lock) later."""
    if not SHM.is_dir():
        yield
        return
    before = {p.name for p in SHM.iterdir()}
    yield
    for name in new_segments(before) - mapped_segments():
        UNMAPPED_AFTER.setdefault(name, request.module.__name__)
