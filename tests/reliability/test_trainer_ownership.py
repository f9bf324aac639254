"""One trainer owns an engine's weight channel (HCCL engine, real server).

- An init that cannot connect (a missing rank, nobody listening, an unresolvable host, a peer
  that accepts and never answers) is answered at once and never stalls generation; the engine
  reports the failure by the end of ``timeout_s``.
- While the owner lives, another trainer's init and an update nobody sends are refused at once,
  naming the owner; the owner's syncs go on, also when the refused call lands inside one.
  Once the owner shuts its engine down, the other trainer takes the channel.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest
import requests

from tests.e2e.weight_sync_cases import PROBE, WeightSyncServers, start_refusal
from tests.support import free_port, greedy_token_ids
from tests.support.streams import TokenClock
from tests.support.trainer import TrainerError, TrainerProcess
from vllm_ascend_rl.client import EngineControlClient

# The shared HCCL engine's sleepable worker has vllm-ascend's NPUWorker weight-update lifecycle
# (no reset_weight_update_target: npu_standin/worker.py NPUWorkerLifecycle).
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.reliability,
    pytest.mark.ascend,
    pytest.mark.timeout(900),
]

TIMEOUT_S = 5
UNREACHABLE = ["missing_rank", "nobody_listening", "unresolvable_host", "silent_peer"]


@contextlib.contextmanager
def unreachable(kind: str):
    """An init_info (address, port, world_size) whose rendezvous cannot complete."""
    if kind == "unresolvable_host":
        yield {
            "master_address": "no-such-host.invalid",
            "master_port": free_port(),
            "world_size": 2,
        }
    elif kind == "nobody_listening":
        yield {"master_address": "127.0.0.1", "master_port": free_port(), "world_size": 2}
    elif kind == "silent_peer":  # accepts connections (the kernel's backlog), never answers
        with socket.create_server(("127.0.0.1", 0), backlog=16) as server:
            port = server.getsockname()[1]
            yield {"master_address": "127.0.0.1", "master_port": port, "world_size": 2}
    else:  # this process hosts rank 0 of 3; the engine's one worker is rank 1, rank 2 never comes
        from vllm_ascend_rl.device import get_device
        from vllm_ascend_rl.weight_transfer.channel import BroadcastChannel

        port = free_port()
        joined: list[str] = []

        def host_rank0() -> None:
            try:
                BroadcastChannel.open(get_device("cpu"), "127.0.0.1", port, 0, 3, TIMEOUT_S)
            except Exception as e:  # expected: rank 2 never comes
                joined.append(str(e))

        rank0 = threading.Thread(target=host_rank0, daemon=True)
        rank0.start()
        yield {"master_address": "127.0.0.1", "master_port": port, "world_size": 3}
        rank0.join(TIMEOUT_S * 3)
        assert joined and "rank 0 of 3" in joined[0], joined  # rank 0 waited, and gave up


def _post(url: str, route: str, body: dict) -> requests.Response:
    return requests.post(url + route, json=body, timeout=120)


class TestOwnership(WeightSyncServers):
    backend = "ascend_rl_hccl"

    @pytest.mark.parametrize("kind", UNREACHABLE)
    def test_a_failed_init_answers_at_once_and_generation_goes_on(
        self, engine, trainer, on_v1, v1_probe, kind
    ):
        trainer.release(engine.url)
        with unreachable(kind) as where, TokenClock(engine.url) as clock:
            t0 = time.monotonic()
            r = _post(
                engine.url,
                "/init_weight_transfer_engine",
                {"init_info": {**where, "timeout_s": TIMEOUT_S}},
            )
            answered = time.monotonic() - t0
            while "init failed" not in (refusal := start_refusal(engine.url)):
                assert "still connecting" in refusal, refusal
                assert time.monotonic() < t0 + TIMEOUT_S + 10, "the init never failed"
                time.sleep(0.2)
            failed = time.monotonic() - t0
            gap = clock.longest_gap(since=t0)
        print(f"{kind}: answered {answered:.2f}s, failed at {failed:.2f}s, longest gap {gap:.2f}s")
        assert r.status_code == 200, r.text
        # Structural bounds, far from any host's speed: the answer does not wait for the
        # rendezvous, the failure comes at one deadline (not per retry), and no token waits on
        # the init (a blocked engine core would stop the stream for timeout_s).
        assert answered < TIMEOUT_S / 2
        assert failed < TIMEOUT_S + 3
        assert gap < TIMEOUT_S / 2
        self.assert_alive_and_intact(engine, v1_probe)

    @pytest.mark.parametrize("window", ["start_weight_update", "update_weights"])
    def test_a_foreign_update_inside_an_open_update_leaves_the_owners_sync_alone(
        self, engine, reference, trainer, on_v1, window
    ):
        """A hand-written update_weights lands right after the owner's ``window`` call: it is
        refused naming the owner, and the owner's update goes on to land exactly (vLLM's and
        vllm-ascend's workers end their record of the update on any error: the plugin's
        worker keeps it when the engine kept the owner's update open)."""
        self.init(trainer, engine)
        result = trainer.send(weight_version="v2", foreign_after=window)
        ((status, text),) = result["foreign"]
        assert status >= 400 and "belongs to trainer" in text, text
        assert "The owner's open update goes on" in text
        v2_probe = greedy_token_ids(reference.url, PROBE, 24)
        assert greedy_token_ids(engine.url, PROBE, 24) == v2_probe

    def test_one_trainer_owns_the_channel(
        self, engine, reference, models, trainer, on_v1, v1_probe, tmp_path, plugin_env
    ):
        owner_pid = trainer.request("ping")["pid"]
        env = self.trainer_env(plugin_env, engine)
        with TrainerProcess(models[0], log_path=tmp_path / "second.log", env=env) as second:
            t0 = time.monotonic()
            with pytest.raises(TrainerError, match="the weight channel belongs to trainer") as e:
                self.init(second, engine)
            assert time.monotonic() - t0 < 15, "the refusal waited"  # init timeout_s=30
            assert f":{owner_pid}:" in str(e.value) and "connected" in str(e.value)
            with pytest.raises(TrainerError, match="send before init"):
                second.send()

            ctl = EngineControlClient(engine.url)
            ctl.pause(mode="abort")
            assert _post(engine.url, "/start_weight_update", {}).status_code == 200
            t0 = time.monotonic()
            update = {
                "names": ["model.norm.weight"],
                "dtype_names": ["bfloat16"],
                "shapes": [[128]],
            }  # well formed, and nobody will send its bytes
            r = _post(engine.url, "/update_weights", {"update_info": update})
            assert r.status_code >= 400 and "belongs to trainer" in r.text, r.text
            assert time.monotonic() - t0 < 15, "the refusal waited"
            # The refused call left the update opened by hand open: it ends as any other.
            assert _post(engine.url, "/finish_weight_update", {}).status_code == 200
            ctl.resume()
            self.assert_alive_and_intact(engine, v1_probe)

            trainer.send(weight_version="v2")  # the owner's sync is untouched
            v2_probe = greedy_token_ids(reference.url, PROBE, 24)
            assert greedy_token_ids(engine.url, PROBE, 24) == v2_probe

            trainer.release(engine.url)  # the owner leaves: the other trainer may take over
            self.init(second, engine)
            second.send(weight_version="v1")
            assert greedy_token_ids(engine.url, PROBE, 24) == v1_probe
