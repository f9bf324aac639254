"""Fixtures shared by unit and end-to-end tests."""

from __future__ import annotations

import pytest

from vllm_ascend_rl.testing import TinyModelSpec, build_tiny_model


@pytest.fixture(scope="session")
def tiny_model():
    """The default tiny checkpoint ("v1" weights, seed 1)."""
    return build_tiny_model(TinyModelSpec(seed=1))
