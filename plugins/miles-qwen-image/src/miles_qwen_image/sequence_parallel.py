"""Sequence parallelism for Qwen-Image: diffusers' own context-parallel plan
(``QwenImageTransformer2DModel._cp_plan``) splits the image and the text tokens over the
ranks, so both must divide. A prompt's text length is whatever its tokens are, so a
forward pre-hook pads the text to a multiple of the sequence-parallel size with zero
embeddings whose ``encoder_hidden_states_mask`` is 0: the transformer's own joint mask
keeps them out of every real token's attention (and the mask travels with the Ulysses
all-to-all), so the real tokens' outputs are unchanged to rounding. Ring attention gives
every key chunk the local chunk's mask, so with a ring degree above 1 a prompt that needs
padding is refused.
"""

from __future__ import annotations

from typing import Any

import torch


class TextPadding:
    """Forward pre-hook (with kwargs) padding ``encoder_hidden_states`` and its mask to a
    multiple of ``degree`` tokens."""

    def __init__(self, degree: int) -> None:
        self.degree = degree

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        hidden = kwargs.get("encoder_hidden_states")
        if hidden is None:
            return None  # the family passes it by name; anything else is left as it is
        pad = -hidden.shape[1] % self.degree
        if not pad:
            return None
        parallel = getattr(module, "_parallel_config", None)
        if parallel is not None and parallel.context_parallel_config.ring_degree > 1:
            # The ring hands every key chunk the local chunk's mask: padding cannot be masked.
            raise ValueError(
                f"--sequence-parallel-size {self.degree} with a ring degree > 1: the prompt's {hidden.shape[1]} text tokens "
                "would need padding, which ring attention cannot mask; use a Ulysses-only split or a prompt length the "
                "split divides"
            )
        mask = kwargs.get("encoder_hidden_states_mask")
        if mask is None:
            mask = torch.ones(hidden.shape[:2], dtype=torch.long, device=hidden.device)
        kwargs["encoder_hidden_states"] = torch.nn.functional.pad(hidden, (0, 0, 0, pad))
        kwargs["encoder_hidden_states_mask"] = torch.nn.functional.pad(mask, (0, pad))
        return args, kwargs


def install(module: torch.nn.Module, degree: int) -> dict[str, Any] | None:
    """Register the text padding on a ``QwenImageTransformer2DModel`` and return diffusers'
    plan for it."""
    module.register_forward_pre_hook(TextPadding(degree), with_kwargs=True)
    return getattr(module, "_cp_plan", None)


__all__ = ["TextPadding", "install"]
