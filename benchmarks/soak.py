"""Soak: many streams across many weight swaps and sleep/wake cycles on one real server.

One engine (HCCL weight transfer, sleepable worker, plugin scheduler) and one trainer process.
Each cycle streams ``--streams`` requests and swaps the weights mid-generation (pause(keep) ->
sync -> resume). Every request must end with all its tokens: a stream that ends short or long
is a lost or duplicated token. Every ``--sleep-every`` cycles the engine sleeps (level 1) and
wakes. After a warm-up cycle, the script records the RSS and open file descriptors of every
server process and the ``/dev/shm`` listing. At the end it compares them and checks that no
server process was replaced. It prints a table and exits 1 if an acceptance figure fails:
0 lost or duplicated tokens, 0 restarts, RSS growth < 1 %, no fd or ``/dev/shm`` leak.

    make soak                       # 32 streams x 20 swap cycles
    python benchmarks/soak.py --streams 8 --cycles 4
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import psutil
from bench_common import init_hccl_trainer

from tests.support import (
    PLUGIN_SCHEDULER,
    VLLMServer,
    build_model_pair,
    engine_args,
)
from tests.support.profile import current_profile, trainer_env
from tests.support.rl_step import PROMPTS, swap_mid_generation
from tests.support.trainer import TrainerProcess
from vllm_ascend_rl.client import EngineControlClient

SHM = Path("/dev/shm")


def server_processes(server: VLLMServer) -> dict[int, psutil.Process]:
    return {pid: psutil.Process(pid) for pid in server.pids()}


def rss_bytes(procs: dict[int, psutil.Process]) -> int:
    return sum(p.memory_info().rss for p in procs.values())


def open_fds(procs: dict[int, psutil.Process]) -> int:
    return sum(p.num_fds() for p in procs.values())


def shm_entries() -> set[str]:
    return {p.name for p in SHM.iterdir()} if SHM.is_dir() else set()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--sleep-every", type=int, default=5, help="cycles; --cycles a multiple")
    args = ap.parse_args()

    v1, v2 = build_model_pair()
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} ({i})" for i in range(args.streams)]
    server = VLLMServer(
        v1,
        kv_cache_gib=2,
        max_model_len=1024,
        extra_args=[
            *engine_args(),
            "--max-num-seqs",
            str(args.streams),
            "--worker-cls",
            current_profile().sleepable_worker,
            "--scheduler-cls",
            PLUGIN_SCHEDULER,
            "--weight-transfer-config",
            json.dumps({"backend": "ascend_rl_hccl"}),
        ],
    )
    env = trainer_env(engine_chips=1, colocated=False)
    lost = sleeps = 0
    problems: list[str] = []
    with server, TrainerProcess(v2, env=env) as trainer:
        ctl = EngineControlClient(server.url, timeout_s=600)
        init_hccl_trainer(trainer, server.url)

        def cycle(i: int) -> None:
            nonlocal lost, sleeps
            trainer.load(v1 if i % 2 else v2)
            out = swap_mid_generation(
                server.url,
                lambda: trainer.send(weight_version=f"cycle-{i}"),
                prompts=prompts,
                max_tokens=args.max_tokens,
            )
            lost += sum(abs(s.num_tokens - args.max_tokens) for s in out.streams)
            problems.extend(f"cycle {i}: {p}" for p in out.problems)
            if args.sleep_every and (i + 1) % args.sleep_every == 0:
                ctl.sleep(1)
                ctl.wake_up()
                sleeps += 1

        cycle(0)  # warm-up: lazy allocations, first-touch pages, the first sync, and a
        ctl.sleep(1)  # sleep/wake, so that both RSS figures are taken after a wake (a wake
        ctl.wake_up()  # maps the KV cache lazily: its untouched pages are not resident)
        procs = server_processes(server)
        rss0, fds0, shm0 = rss_bytes(procs), open_fds(procs), shm_entries()
        t0 = time.monotonic()
        for i in range(1, args.cycles + 1):
            cycle(i)
            print(f"cycle {i}/{args.cycles}: {len(problems)} problem(s)", flush=True)
        elapsed = time.monotonic() - t0
        ctl.sleep(1)  # measured as at the start: right after a wake
        ctl.wake_up()
        sleeps += 2  # this one and the warm-up's
        after = server_processes(server)
        restarts = len(set(procs) ^ set(after))
        rss1, fds1, shm1 = rss_bytes(after), open_fds(after), shm_entries()
    growth = (rss1 - rss0) / rss0
    rows = [
        ("streams x swap cycles", f"{args.streams} x {args.cycles}", ""),
        ("sleep/wake cycles", str(sleeps), ""),
        ("wall time", f"{elapsed:.0f} s", ""),
        ("lost or duplicated tokens", str(lost), "0"),
        ("streams that did not finish whole", str(len(problems)), "0"),
        ("server processes replaced", str(restarts), "0"),
        ("RSS after warm-up -> end", f"{rss0 >> 20} -> {rss1 >> 20} MiB ({growth:+.2%})", "< 1 %"),
        ("open fds after warm-up -> end", f"{fds0} -> {fds1}", "no growth"),
        ("new /dev/shm entries", str(len(shm1 - shm0)), "0"),
    ]
    print("\n| figure | value | target |\n|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    for p in problems[:10]:
        print(p, file=sys.stderr)
    ok = not lost and not problems and not restarts and growth < 0.01 and fds1 <= fds0
    ok = ok and not (shm1 - shm0)
    print("\nsoak:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
