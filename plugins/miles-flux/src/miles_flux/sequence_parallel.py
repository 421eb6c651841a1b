"""Sequence parallelism for FLUX: diffusers' own context-parallel plan
(``FluxTransformer2DModel._cp_plan``, ``Flux2Transformer2DModel._cp_plan``) splits the image
tokens, the text tokens and their position ids over the ranks, so both token counts must
divide by the split. FLUX's text has no attention mask (the pipelines pad T5 or Qwen3 text
to ``max_sequence_length`` and attend to the padding), so a text length the split does not
divide cannot be padded invisibly, as Qwen-Image's masked text can: a forward pre-hook
refuses it with the setting to change instead of letting the split fail deep inside
diffusers. The default 512 tokens divide by every power of two up to 512.
"""

from __future__ import annotations

from typing import Any

import torch


class TokenCountCheck:
    """Forward pre-hook (with kwargs) refusing token counts that ``degree`` does not divide."""

    def __init__(self, degree: int) -> None:
        self.degree = degree

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        text = kwargs.get("encoder_hidden_states")
        if text is not None and text.shape[1] % self.degree:
            raise ValueError(
                f"--sequence-parallel-size {self.degree}: the prompt's {text.shape[1]} text tokens do not divide into "
                f"{self.degree} parts, and FLUX's unmasked text cannot be padded; set "
                "extra_sampling_params.max_sequence_length to a multiple of the split (the default 512 is one)"
            )
        image = kwargs.get("hidden_states")
        if image is not None and image.shape[1] % self.degree:
            raise ValueError(
                f"--sequence-parallel-size {self.degree}: the {image.shape[1]} packed image tokens do not divide into "
                f"{self.degree} parts; choose --diffusion-height and --diffusion-width whose 2x2 latent patches do"
            )


def install(module: torch.nn.Module, degree: int) -> dict[str, Any] | None:
    """Register the token-count check on a FLUX transformer and return diffusers' plan for it."""
    module.register_forward_pre_hook(TokenCountCheck(degree), with_kwargs=True)
    return getattr(module, "_cp_plan", None)


__all__ = ["TokenCountCheck", "install"]
