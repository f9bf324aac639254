"""The router's rules that need no engine: what counts as a bounce, which paths it forwards."""

from __future__ import annotations

import pytest

from vllm_ascend_rl.router import FANNED_OUT, Completion, Piece, is_data_plane


def piece(finish: str | None, stop: object, tokens: list[int]) -> Piece:
    return Piece(tokens, "x" * len(tokens), finish, stop, [1, 2, 3])


@pytest.mark.parametrize(
    ("finish", "stop", "resent"),
    [
        ("abort", "recomputed", True),  # the engine's bounce
        ("stop", "recomputed", False),  # a user's stop=["recomputed"] matched: a real end
        ("abort", None, False),  # a client or pause abort
        ("length", None, False),
    ],
)
def test_only_the_bounce_marker_is_resent(finish, stop, resent):
    completion = Completion({"prompt": [1, 2, 3], "max_tokens": 10, "stop": ["recomputed"]}, 4)
    assert completion.absorb(piece(finish, stop, [7, 8])) is resent
    if resent:  # the resend continues from prompt + generated, for what is left
        body = completion.next_body(stream=False)
        assert body["prompt"] == [1, 2, 3, 7, 8] and body["max_tokens"] == 8


@pytest.mark.parametrize(
    ("path", "forwarded"),
    [
        ("/v1/completions", True),
        ("/v1/chat/completions", True),
        ("/health", True),
        ("/metrics", True),
        ("/init_weight_transfer_engine", False),
        ("/start_weight_update", False),
        ("/update_weights", False),
        ("/finish_weight_update", False),
        ("/collective_rpc", False),
        ("/release_kv_cache_memory", False),
        ("/scale_elastic_ep", False),
    ],
)
def test_only_data_plane_paths_go_to_one_engine(path, forwarded):
    assert is_data_plane(path) is forwarded
    assert path not in FANNED_OUT
