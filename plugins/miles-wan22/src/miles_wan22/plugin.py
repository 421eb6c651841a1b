"""Entry-point module of the Wan 2.2 plugin (group ``miles.plugins``).

Registration only: this module must stay import-light (no torch, diffusers or
transformers, not even indirectly) so that discovering plugins loads no model code.
"""

from __future__ import annotations

from typing import Any

from miles_core.api import ModelFamilySpec, hookimpl

FAMILY_NAME = "wan2_2"
TI2V_FAMILY_NAME = "wan2_2_ti2v"
I2V_FAMILY_NAME = "wan2_2_i2v"
EXPERT_FAMILIES = (FAMILY_NAME, I2V_FAMILY_NAME)
"""The two-expert families: the rules on the experts they train are the same."""

EXPERTS = ("transformer", "transformer_2")

LOW_NOISE_EXPERT = EXPERTS[1]

LORA_TARGET_MODULES = ("to_q", "to_k", "to_v", "to_out.0")
"""The attention projections of every Wan transformer (each expert of A14B, TI2V-5B's one)."""

GUIDANCE_SCALE_2_REQUIRED = (
    "--diffusion-guidance-scale-2 is required when --update-weight-target-module trains transformer_2 (the "
    "low-noise expert): the guidance scale that expert is sampled and trained with is part of what it learns, "
    "so it is given, not copied from --diffusion-guidance-scale (diffusers' fallback, used while transformer_2 "
    "stays frozen)"
)


@hookimpl
def miles_register_model_families() -> list[ModelFamilySpec]:
    """The ``wan2_2`` family (A14B: two experts split by timestep), the ``wan2_2_ti2v``
    family (TI2V-5B: one transformer, per-token timesteps) and the ``wan2_2_i2v`` family
    (I2V-A14B: image-to-video with two experts)."""
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
            lora_target_modules=LORA_TARGET_MODULES,
            n_samples_per_prompt=16,
            rollout_microgroup_size=8,
            generation_options=("num_frames", "fps", "guidance_scale_2"),
        ),
        ModelFamilySpec(
            name=TI2V_FAMILY_NAME,
            ref="miles_wan22.ti2v:WanTI2VFamily",
            description=(
                "Wan 2.2 TI2V-5B text-to-video (diffusers WanPipeline with expand_timesteps): one "
                "transformer with a timestep per latent token, Wan 2.2's VAE (48 channels, 16x spatial, "
                "4x temporal)"
            ),
            # More specific than wan2_2's "wan2.2": a name matching both is this family's
            # (family_match prefers the pattern that contains the other).
            checkpoint_patterns=("wan2.2-ti2v", "wan-2.2-ti2v", "ti2v-5b"),
            pipeline_classes=("WanPipeline",),
            checkpoint_check="miles_wan22.checkpoint:ti2v_wan",
            trainable_components=("transformer",),
            lora_target_modules=LORA_TARGET_MODULES,
            # No RL recipe is published for TI2V-5B: the reference's Wan 2.2 group and
            # microgroup (16 / 8), which the smaller dense model fits at least as well.
            n_samples_per_prompt=16,
            rollout_microgroup_size=8,
            # One transformer: WanPipeline refuses guidance_scale_2 without a boundary_ratio.
            generation_options=("num_frames", "fps"),
            # Text- or image-to-video (the family class's image_input; they must agree).
            image_input="optional",
        ),
        ModelFamilySpec(
            name=I2V_FAMILY_NAME,
            ref="miles_wan22.i2v:WanI2VFamily",
            description=(
                "Wan 2.2 I2V-A14B image-to-video (diffusers WanImageToVideoPipeline): wan2_2's two experts "
                "switched at boundary_ratio, each reading the latents with the image's first-frame mask "
                "and VAE latents concatenated behind them"
            ),
            # More specific than wan2_2's "wan2.2" (family_match prefers the pattern that
            # contains the other): Wan-AI/Wan2.2-I2V-A14B-Diffusers is this family's.
            checkpoint_patterns=("wan2.2-i2v", "wan-2.2-i2v", "i2v-a14b"),
            # WanImageToVideoPipeline also runs Wan 2.1 I2V (CLIP image embeddings) and
            # TI2V-5B's image mode: the check tells I2V-A14B apart.
            pipeline_classes=("WanImageToVideoPipeline",),
            checkpoint_check="miles_wan22.checkpoint:i2v_wan",
            trainable_components=("transformer", "transformer_2"),
            lora_target_modules=LORA_TARGET_MODULES,
            # No RL recipe is published for I2V-A14B: wan2_2's (the reference's Wan 2.2 values).
            n_samples_per_prompt=16,
            rollout_microgroup_size=8,
            generation_options=("num_frames", "fps", "guidance_scale_2"),
            image_input="required",
        ),
    ]


def sft_needs_both_experts(value: str) -> str:
    return (
        f"--loss-type sft_loss and --update-weight-target-module {value}: SFT draws each row's step over the whole "
        "schedule, so some rows would fall on the frozen expert; train both experts "
        "(--update-weight-target-module transformer,transformer_2)"
    )


@hookimpl
def miles_validate_config(config: Any) -> list[str]:
    """Wan 2.2's rules on the experts ``--update-weight-target-module`` trains, for both
    two-expert families (``wan2_2`` and ``wan2_2_i2v``; the core checks that it names
    modules the family has).

    ``--diffusion-guidance-scale-2`` is required when the low-noise expert trains on
    rollouts (the reference's rule; SFT samples nothing); otherwise an unset value is
    diffusers' fallback, ``guidance_scale_2 = guidance_scale``. One expert trains under the
    policy losses (the trainer leaves the other expert's steps out); SFT would regress rows
    of the frozen expert, so it trains both.
    """
    if getattr(config, "model_family", None) not in EXPERT_FAMILIES:
        return []
    targets = str(getattr(config, "update_weight_target_module", None) or ",".join(EXPERTS))
    trained = {name.strip() for name in targets.split(",") if name.strip()}
    sft = getattr(config, "loss_type", None) == "sft_loss"
    errors = []
    if LOW_NOISE_EXPERT in trained and not sft and getattr(config, "diffusion_guidance_scale_2", None) is None:
        errors.append(GUIDANCE_SCALE_2_REQUIRED)
    if sft and len(trained & set(EXPERTS)) == 1:
        errors.append(sft_needs_both_experts(targets))
    return errors
