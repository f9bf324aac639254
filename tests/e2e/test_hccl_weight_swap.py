"""The seed's async-RL e2e with the HCCL engine on CPU (gloo), plus its error paths.

A server starts on v1 weights with ``--weight-transfer-config '{"backend": "ascend_rl_hccl"}'``
and the plugin scheduler; a separate trainer process holds v2 (same shape, other seed). Requests
stream; ``/pause?mode=keep`` -> ``send_weights()`` -> ``/resume``; every request must finish
with all its tokens, and greedy generation on a fresh v2 server from prompt +
tokens-before-pause must reproduce the tokens after the pause exactly. The shared cases are in
``weight_sync_cases``.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import requests

from tests.e2e.weight_sync_cases import PROBE, WeightSyncCases
from tests.support import free_port, greedy_token_ids
from tests.support.rl_step import check_continuations, swap_mid_generation
from tests.support.streams import settled
from tests.support.trainer import TrainerError
from tests.support.vllm_features import has_weight_version_spans
from vllm_ascend_rl.client import EngineControlClient

pytestmark = [pytest.mark.e2e, pytest.mark.ascend, pytest.mark.timeout(900)]


def _post(engine, route, **kw):
    return requests.post(engine.url + route, timeout=120, **kw)


def _init_request(engine, **init_info):
    return _post(
        engine,
        "/init_weight_transfer_engine",
        json={
            "init_info": {"master_address": "127.0.0.1", "master_port": free_port(), **init_info}
        },
    )


class TestHCCLWeightSwap(WeightSyncCases):
    backend = "ascend_rl_hccl"
    finish_fails_under = "restore"

    def test_syncs_beside_vllm_ascends_registrations(
        self, engine, reference, trainer, on_v1, plugin_env
    ):
        """vllm-ascend's engine names and ours are registered side by side in a process that
        ran every general plugin (the trainer); the stand-in ran in the API server, the engine
        core, the worker and the trainer (4 processes); a sync through ascend_rl_hccl still
        lands exactly."""
        registered = trainer.registered_engines()
        assert {"hccl", "npu_ipc", "ascend_rl_hccl", "ascend_rl_npu_ipc"} <= set(
            registered["engine"]
        ), registered
        assert {"ascend_rl_hccl", "ascend_rl_npu_ipc"} <= set(registered["trainer"]), registered
        if "STANDIN_MARKER" in plugin_env:
            pids = set(Path(plugin_env["STANDIN_MARKER"]).read_text().split())
            assert len(pids) >= 4, pids
        self.init(trainer, engine)
        trainer.send(weight_version="v2")
        assert greedy_token_ids(engine.url, PROBE, 24) == greedy_token_ids(reference.url, PROBE, 24)

    def test_weight_version_reaches_weight_info(self, engine, trainer, on_v1):
        """The version given to send_weights() reaches finish_weight_update."""
        self.init(trainer, engine)
        trainer.send(weight_version="v2-info")
        assert requests.get(engine.url + "/weight_info", timeout=10).json() == {
            "weight_version": "v2-info"
        }

    @pytest.mark.skipif(
        not has_weight_version_spans(),
        reason="vLLM 0.30.0 has no per-output weight-version spans (0.32 has them)",
    )
    def test_weight_version_tags_the_tokens_it_produced(self, engine, trainer, on_v1):
        """vLLM's per-output weight-version spans split one request's tokens into v1's and
        v2's."""
        self.init(trainer, engine)
        total = 1500  # long enough that the pause lands mid-stream on a loaded machine
        tokens: list[int] = []
        final: dict = {}
        errors: list[BaseException] = []
        started = threading.Event()

        def generate() -> None:
            body = {
                "model": "tiny",
                "token_ids": [11, 12, 13, 14],
                "stream": True,
                "sampling_params": {"max_tokens": total, "temperature": 0, "ignore_eos": True},
            }
            try:
                with requests.post(
                    engine.url + "/inference/v1/generate", json=body, stream=True, timeout=300
                ) as r:
                    assert r.status_code == 200, r.text
                    for line in r.iter_lines():
                        if line.startswith(b"data: {"):
                            choice = json.loads(line[6:])["choices"][0]
                            tokens.extend(choice.get("token_ids") or [])
                            if len(tokens) >= 8:
                                started.set()
                            final.update(choice)
            except BaseException as e:
                errors.append(e)
            finally:
                started.set()

        thread = threading.Thread(target=generate, daemon=True)
        thread.start()
        assert started.wait(120) and not errors, errors
        ctl = EngineControlClient(engine.url)
        ctl.pause("keep")
        split = settled(lambda: len(tokens), engine.url)
        trainer.send(weight_version="v2")
        ctl.resume()
        thread.join(300)
        assert len(tokens) == total and 0 < split < total
        assert final["weight_versions"] == [
            {"version": "v1", "start": 0, "end": split},
            {"version": "v2", "start": split, "end": total},
        ]
        assert requests.get(engine.url + "/weight_info", timeout=10).json() == {
            "weight_version": "v2"
        }

    def test_clear_cache_false_continues_on_stale_kv(self, engine, reference, trainer, on_v1):
        """Documented fact: pause(keep, clear_cache=false) keeps the v1 KV cache, so after a
        swap the continuation attends to stale keys/values and differs from a v2 recompute."""
        self.init(trainer, engine)
        out = swap_mid_generation(
            engine.url, lambda: trainer.send(weight_version="v2"), clear_cache=False
        )
        assert not out.problems, out.problems
        matches = check_continuations(reference.url, out)
        assert not any(matches), f"expected every continuation to differ (stale KV): {matches}"

    def test_init_with_wrong_world_size(self, engine, trainer, on_v1, v1_probe):
        with pytest.raises(TrainerError, match=r"world_size=3 but the engine .* has 1 worker"):
            self.init(trainer, engine, world_size=3)
        r = _init_request(engine, world_size=1)
        assert r.status_code >= 400 and "world_size" in r.text, r.text
        self.assert_alive_and_intact(engine, v1_probe)
