"""The Cosmos 3 model family (``Cosmos3OmniPipeline`` / ``Cosmos3OmniTransformer``).

Import-light: torch and diffusers load only inside the methods that need them.

Cosmos3OmniTransformer is a mixture-of-transformers: every decoder layer carries two
parallel sets of weights, one for the causal text ("understanding") tokens and one for
the vision/sound/action ("generation") tokens. The generation tokens attend to the
understanding keys/values, so the understanding path conditions generation, but its own
outputs are never decoded by the diffusion pipeline. Parameter names (relative to the
transformer):

Generation path (trainable):
    layers.<i>.self_attn.add_q_proj / add_k_proj / add_v_proj / to_add_out   (LoRA targets)
    layers.<i>.self_attn.norm_added_q / norm_added_k
    layers.<i>.self_attn.k_norm_und_for_gen   (only when use_und_k_norm_for_gen: it normalises
                                              the understanding keys as the generation
                                              queries see them, so only generation uses it)
    layers.<i>.mlp_moe_gen.*
    layers.<i>.input_layernorm_moe_gen / post_attention_layernorm_moe_gen
    norm_moe_gen, proj_in, proj_out, time_embedder.*
    audio_proj_in / audio_proj_out / audio_modality_embed      (sound_gen checkpoints)
    action_proj_in / action_proj_out / action_modality_embed   (action_gen checkpoints)

Understanding tower (frozen):
    embed_tokens
    layers.<i>.self_attn.to_q / to_k / to_v / to_out / norm_q / norm_k
    layers.<i>.mlp.*
    layers.<i>.input_layernorm / post_attention_layernorm
    norm, lm_head   (unused by the diffusion forward)

Rule of thumb: a name containing ``moe_gen``, ``add_``, ``_added_`` or ``und_for_gen``, or
starting with ``proj_``, ``time_embedder``, ``audio_`` or ``action_`` is generation; the rest
is understanding. Backpropagating the velocity reaches the understanding tower too
(through the keys/values it contributes; only ``norm`` and ``lm_head`` get no gradient), so
full fine-tuning must freeze it explicitly; the default LoRA targets touch generation only.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from miles_core.family import ModelFamily

# Cosmos3OmniPipeline.__call__ hard-codes these when height/width are None (and the run is
# not action-conditioned); they do not depend on any checkpoint configuration.
_DEFAULT_HEIGHT = 720
_DEFAULT_WIDTH = 1280


class Cosmos3Family(ModelFamily):
    """Cosmos 3: one packed sample per transformer call, CFG as two calls."""

    pipeline_class: ClassVar[str] = "diffusers:Cosmos3OmniPipeline"

    @classmethod
    def build_tiny_pipeline(cls, out_dir: str | Path, *, seed: int = 0) -> Path:
        """Write a randomly initialised tiny Cosmos3OmniPipeline to ``out_dir``."""
        from miles_cosmos3.tiny import build

        return build(out_dir, seed=seed)

    @classmethod
    def native_size(cls, checkpoint: str | Path) -> tuple[int, int] | None:
        """``(720, 1280)``: the pipeline's fixed defaults, whatever the checkpoint."""
        return (_DEFAULT_HEIGHT, _DEFAULT_WIDTH)
