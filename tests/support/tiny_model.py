"""Mixed checkpoints for partial-update tests. The tiny checkpoints themselves are defined in
``examples/plumbing/tiny_model.py`` and re-exported here."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

from examples.plumbing.tiny_model import (  # noqa: F401  (re-exported)
    TinyModelSpec,
    build_tiny_model,
    load_hf_model,
    parameter_shapes,
)


def mixed_checkpoint(base: Path, new: Path, keep: Sequence[str], target: Path) -> Path:
    """A copy of ``new`` whose tensors named with a prefix in ``keep`` come from ``base``:
    what an engine on ``base`` holds after a partial update from ``new`` that froze ``keep``."""
    from safetensors.torch import load_file, save_file

    old, weights = (
        load_file(str(base / "model.safetensors")),
        load_file(str(new / "model.safetensors")),
    )
    for name in weights:
        if name.startswith(tuple(keep)):
            weights[name] = old[name]
    shutil.copytree(new, target)
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target
