"""The control shared by the image-to-video alignment-probe tests: the trainer's
recomputation (and not the engine's sampling) conditions on a slightly shifted image
latent, which the probe must report."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from miles_core import family_checks
from miles_core.family import Conditioning, GenerationParams, Latents
from miles_core.training.trainer import Trainer
from miles_wan22.wan_base import IMAGE_LATENTS


def check_probe_catches_a_trainer_side_image_shift(family_cls: type, args: Sequence[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the probe on ``args`` with the trainer's image latent shifted by 0.01: it must
    fail naming the drift. Every prediction (engine and trainer) must see the image latent."""
    in_trainer = [False]
    recompute, predict = Trainer._log_prob, family_cls.predict

    def trainer_log_prob(self: Trainer, data: dict) -> Any:
        in_trainer[0] = True
        try:
            return recompute(self, data)
        finally:
            in_trainer[0] = False

    def shifted(self: Any, latents: Latents, timestep: torch.Tensor, cond: Conditioning, params: GenerationParams) -> Latents:
        assert IMAGE_LATENTS in cond.positive, "a prediction of an image row lacks the engine's image latent"
        if in_trainer[0]:
            cond = Conditioning({**cond.positive, IMAGE_LATENTS: cond.positive[IMAGE_LATENTS] + 0.01}, cond.negative)
        return predict(self, latents, timestep, cond, params)

    monkeypatch.setattr(Trainer, "_log_prob", trainer_log_prob)
    monkeypatch.setattr(family_cls, "predict", shifted)
    with pytest.raises(AssertionError, match=r"rollout 0: train/log_prob_mean_abs_diff = .*expected exactly 0"):
        family_checks.check_alignment_probe(args)
