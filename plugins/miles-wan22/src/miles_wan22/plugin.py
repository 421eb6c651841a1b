"""Entry-point module of the Wan 2.2 plugin (group ``miles.plugins``).

Registration only: this module must stay import-light (no torch, diffusers or
transformers, not even indirectly) so that discovering plugins loads no model code.
"""

from __future__ import annotations

from typing import Any

from miles_core import ModelFamilySpec, hookimpl

FAMILY_NAME = "wan2_2"

GUIDANCE_SCALE_2_REQUIRED = (
    "--diffusion-guidance-scale-2 is required for the Wan 2.2 family: the low-noise expert "
    "(transformer_2) has its own guidance scale and there is no fallback"
)


@hookimpl
def miles_register_model_families() -> list[ModelFamilySpec]:
    """The ``wan2_2`` family: two experts split by timestep, both trainable."""
    return [
        ModelFamilySpec(
            name=FAMILY_NAME,
            ref="miles_wan22.family:Wan22Family",
            description=(
                "Wan 2.2 text-to-video (diffusers WanPipeline): a high-noise expert "
                "(transformer) and a low-noise expert (transformer_2) switched at "
                "boundary_ratio x num_train_timesteps"
            ),
            checkpoint_patterns=("wan2.2", "wan-2.2"),
            trainable_components=("transformer", "transformer_2"),
            lora_target_modules=("to_q", "to_k", "to_v", "to_out.0"),
            n_samples_per_prompt=16,
            rollout_microgroup_size=8,
            generation_options=("num_frames", "fps", "guidance_scale_2"),
        )
    ]


@hookimpl
def miles_validate_config(config: Any) -> list[str]:
    """Require ``--diffusion-guidance-scale-2`` for Wan 2.2.

    diffusers silently reuses ``guidance_scale`` for the low-noise expert when
    ``guidance_scale_2`` is None; the reference refuses to guess, and so do we.
    """
    if getattr(config, "model_family", None) != FAMILY_NAME:
        return []
    if getattr(config, "diffusion_guidance_scale_2", None) is None:
        return [GUIDANCE_SCALE_2_REQUIRED]
    return []
