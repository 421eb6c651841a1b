"""Sequence parallelism for SD3's MMDiT transformer, which diffusers gives no context-parallel
plan and whose attention processor (``JointAttnProcessor2_0``) calls torch's attention
directly.

SD3's joint attention attends over the image tokens and the text tokens together, so
both streams are split over the ranks: each rank keeps ``1/SP`` of the image tokens and
``1/SP`` of the text tokens through every block, and the attention's all-to-all (Ulysses)
or ring reassembles the whole joint sequence per head. Attention does not depend on the
order of its keys, so the rank-by-rank order ``[image_0, text_0, image_1, text_1, ...]``
gives every token the output it gets unsplit (to rounding). The last block drops the text
stream; the image tokens are gathered after ``proj_out``.

SD3's text is 77 CLIP tokens plus ``max_sequence_length`` T5 tokens (333 by default),
which SP ranks rarely divide. :class:`TextPadding` pads the text to a multiple of SP with
zero embeddings before the forward, and :class:`DispatchingJointAttnProcessor` masks the
padded tokens out as keys: they never reach a real token, and the padded queries are
dropped with the text stream. Masks travel with the Ulysses all-to-all; ring attention
keeps one rank's mask for every key chunk, so a ring degree above 1 needs a text length
SP divides (no padding).
"""

from __future__ import annotations

from typing import Any

import torch

PLAN_BLOCK = "transformer_blocks.0"


class TextPadding:
    """The text length of the current forward, before and after padding to a multiple of
    ``degree`` (a forward pre-hook on the transformer sets them)."""

    def __init__(self, degree: int) -> None:
        self.degree = degree
        self.text_tokens = 0
        self.padded_tokens = 0

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        key = "encoder_hidden_states"
        if key in kwargs:
            hidden = kwargs[key]
        elif len(args) > 1:
            hidden = args[1]
        else:
            return None
        self.text_tokens = int(hidden.shape[1])
        pad = -self.text_tokens % self.degree
        self.padded_tokens = self.text_tokens + pad
        if not pad:
            return None
        hidden = torch.nn.functional.pad(hidden, (0, 0, 0, pad))
        if key in kwargs:
            kwargs[key] = hidden
        else:
            args = (args[0], hidden, *args[2:])
        return args, kwargs


class DispatchingJointAttnProcessor:
    """``JointAttnProcessor2_0``'s computation with the attention itself through diffusers'
    ``dispatch_attention_fn`` (its backend and ``_parallel_config``, which diffusers'
    context parallelism reads), and the padded text tokens masked out as keys."""

    _attention_backend: Any = None
    _parallel_config: Any = None

    def __init__(self, padding: TextPadding) -> None:
        self.padding = padding

    def _key_mask(self, batch: int, image_tokens: int, text_tokens: int, like: torch.Tensor) -> torch.Tensor | None:
        """This rank's additive mask over its keys ``[image, text]``: ``-inf`` on padded text."""
        padding = self.padding
        if padding.padded_tokens == padding.text_tokens:
            return None  # the same on every rank: no rank passes a mask, none waits for one
        if self._parallel_config is not None and self._parallel_config.context_parallel_config.ring_degree > 1:
            raise ValueError(
                f"--sequence-parallel-size with a ring degree > 1: SD3's text of {padding.text_tokens} tokens would need "
                f"padding to {padding.padded_tokens}, and ring attention cannot mask it; choose a max_sequence_length "
                "that makes 77 + it divisible by the sequence-parallel size, or a Ulysses-only split"
            )
        index = 0
        if self._parallel_config is not None:
            mesh = self._parallel_config.context_parallel_config._flattened_mesh
            index = torch.distributed.get_rank(mesh.get_group())
        positions = torch.arange(text_tokens, device=like.device) + index * text_tokens
        text = torch.zeros(text_tokens, dtype=like.dtype, device=like.device).masked_fill(positions >= padding.text_tokens, float("-inf"))
        mask = torch.cat([torch.zeros(image_tokens, dtype=like.dtype, device=like.device), text])
        return mask.expand(batch, -1).contiguous()

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        from diffusers.models.attention_dispatch import dispatch_attention_fn

        batch, image_tokens = hidden_states.shape[0], hidden_states.shape[1]
        query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        head_dim = key.shape[-1] // attn.heads
        # (batch, tokens, heads, head_dim): the dispatcher's layout.
        query, key, value = (x.view(batch, -1, attn.heads, head_dim) for x in (query, key, value))
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        mask = None
        if encoder_hidden_states is not None:
            text_q = attn.add_q_proj(encoder_hidden_states).view(batch, -1, attn.heads, head_dim)
            text_k = attn.add_k_proj(encoder_hidden_states).view(batch, -1, attn.heads, head_dim)
            text_v = attn.add_v_proj(encoder_hidden_states).view(batch, -1, attn.heads, head_dim)
            if attn.norm_added_q is not None:
                text_q = attn.norm_added_q(text_q)
            if attn.norm_added_k is not None:
                text_k = attn.norm_added_k(text_k)
            query, key, value = (torch.cat(pair, dim=1) for pair in ((query, text_q), (key, text_k), (value, text_v)))
            mask = self._key_mask(batch, image_tokens, text_q.shape[1], query)
        out = dispatch_attention_fn(
            query, key, value, attn_mask=mask, backend=self._attention_backend, parallel_config=self._parallel_config
        )
        out = out.flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is not None:
            out, text_out = out[:, :image_tokens], out[:, image_tokens:]
            if not attn.context_pre_only:
                text_out = attn.to_add_out(text_out)
        out = attn.to_out[1](attn.to_out[0](out))
        return (out, text_out) if encoder_hidden_states is not None else out


def install(module: torch.nn.Module, degree: int) -> dict[str, Any]:
    """Prepare an ``SD3Transformer2DModel`` for sequence parallelism over ``degree`` ranks
    (dispatching processors on every attention, the text padding hook) and return its
    context-parallel plan."""
    from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput
    from diffusers.models.attention_processor import Attention

    padding = TextPadding(degree)
    processor = DispatchingJointAttnProcessor(padding)
    for sub in module.modules():
        if isinstance(sub, Attention):
            sub.set_processor(processor)
    module.register_forward_pre_hook(padding, with_kwargs=True)
    split = ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)
    return {
        PLAN_BLOCK: {"hidden_states": split, "encoder_hidden_states": split},
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }


__all__ = ["DispatchingJointAttnProcessor", "TextPadding", "install"]
