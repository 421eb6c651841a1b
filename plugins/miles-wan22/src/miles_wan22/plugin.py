"""Entry-point module of the Wan 2.2 plugin (group ``miles.plugins``).

Registration only: this module must stay import-light (no torch, diffusers or
transformers, not even indirectly) so that discovering plugins loads no model code.
"""

from __future__ import annotations

from typing import Any

from miles_core.api import ModelFamilySpec, hookimpl

FAMILY_NAME = "wan2_2"

EXPERTS = ("transformer", "transformer_2")

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
            # WanPipeline also runs Wan 2.1 and Wan 2.2 TI2V-5B (one transformer): the
            # trainable components (both experts) and the check tell A14B apart.
            pipeline_classes=("WanPipeline",),
            checkpoint_check="miles_wan22.checkpoint:two_expert_wan",
            trainable_components=("transformer", "transformer_2"),
            lora_target_modules=("to_q", "to_k", "to_v", "to_out.0"),
            n_samples_per_prompt=16,
            rollout_microgroup_size=8,
            generation_options=("num_frames", "fps", "guidance_scale_2"),
        )
    ]


def both_experts_required(value: str) -> str:
    return (
        f"--update-weight-target-module {value}: the Wan 2.2 family trains both experts, "
        "--update-weight-target-module transformer,transformer_2 (a rollout's SDE steps fall on both sides of the "
        "expert boundary, and the trainer cannot skip the steps of an expert it does not train)"
    )


@hookimpl
def miles_validate_config(config: Any) -> list[str]:
    """Require ``--diffusion-guidance-scale-2`` for Wan 2.2, and both experts as
    ``--update-weight-target-module``.

    diffusers silently reuses ``guidance_scale`` for the low-noise expert when
    ``guidance_scale_2`` is None; the reference refuses to guess, and so do we. Training
    one expert alone would back-propagate the other expert's steps through frozen
    weights (a crash deep in autograd), so it is refused here with the flag to set.
    """
    if getattr(config, "model_family", None) != FAMILY_NAME:
        return []
    errors = []
    if getattr(config, "diffusion_guidance_scale_2", None) is None:
        errors.append(GUIDANCE_SCALE_2_REQUIRED)
    targets = getattr(config, "update_weight_target_module", None)
    if targets is not None:
        names = {name.strip() for name in str(targets).split(",") if name.strip()}
        if names != set(EXPERTS):
            errors.append(both_experts_required(str(targets)))
    return errors
