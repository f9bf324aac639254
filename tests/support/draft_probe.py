"""A worker extension (``--worker-extension-cls tests.support.draft_probe.DraftProbe``) that
reads the speculative-decoding drafter's weights, which vLLM's routes (``/weight_checker``)
do not cover; reached through ``/collective_rpc``."""

from __future__ import annotations

import hashlib

import torch

from vllm_ascend_rl.worker.ledger import drafter_model


class DraftProbe:
    def drafter_checksums(self, target: str = "") -> dict[str, str]:
        """sha256 of each of the drafter's parameters (the served model's with ``target``; on
        CPU, vLLM's linear layers keep their weights only in a prepacked copy: a forward pass
        shows those)."""
        runner = self.model_runner  # type: ignore[attr-defined]
        drafter = runner.get_model() if target else drafter_model(runner)
        assert drafter is not None, "the engine has no drafter"
        return {
            name: hashlib.sha256(
                p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
            ).hexdigest()[:16]
            for name, p in drafter.named_parameters()
        }
