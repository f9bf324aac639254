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


def spec_decode_pair(source: Path) -> tuple[Path, Path]:
    """``(target, drafter)`` for speculative decoding, made from a tiny checkpoint once (beside
    it): the target is ``source`` with every layer after the first muted (its attention's and
    MLP's output projections zero, so the residual stream passes it unchanged), the drafter a
    one-layer model of the same weights. The drafter therefore predicts exactly the target's
    next token (a speculative decoder accepts its drafts), until one of them is updated alone;
    and its checkpoint differs from the target's (no ``model.layers.1.*``)."""
    import json
    import tempfile

    from safetensors.torch import load_file, save_file

    made = (source.parent / f"{source.name}-muted", source.parent / f"{source.name}-draft")
    if all((path / "model.safetensors").exists() for path in made):
        return made
    import torch

    weights = load_file(str(source / "model.safetensors"))
    later = [n for n in weights if n.startswith("model.layers.") and ".layers.0." not in n]
    muted = {
        n: torch.zeros_like(t)
        if n in later and n.endswith(("o_proj.weight", "down_proj.weight"))
        else t
        for n, t in weights.items()
    }
    first = {n: t for n, t in weights.items() if n not in later}
    for path, tensors, layers in ((made[0], muted, None), (made[1], first, 1)):
        tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=source.parent))
        shutil.copytree(source, tmp, dirs_exist_ok=True)
        if layers:
            config = json.loads((tmp / "config.json").read_text())
            (tmp / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        try:
            tmp.rename(path)
        except OSError:  # another builder won the race
            shutil.rmtree(tmp, ignore_errors=True)
    return made
