"""Entry-point module of miles-ltx (group ``miles.plugins``, name ``ltx``).

Registration only: imports nothing heavier than the core's public API, so discovering
the plugin never loads torch, diffusers or transformers.
"""

from __future__ import annotations

from miles_core.api import ModelFamilySpec, hookimpl


@hookimpl
def miles_register_model_families() -> list[ModelFamilySpec]:
    """The ``ltx`` family: LTX-2 / LTX-2.3 text-to-video with audio."""
    return [
        ModelFamilySpec(
            name="ltx",
            ref="miles_ltx.family:LtxFamily",
            description="LTX-2 / LTX-2.3 (diffusers LTX2Pipeline): video with an audio branch",
            checkpoint_patterns=("ltx",),
            pipeline_classes=("LTX2Pipeline",),
            trainable_components=("transformer",),
            lora_target_modules=("to_q", "to_k", "to_v", "to_out.0", "net.0.proj", "net.2"),
            # Reference LTX-2.3 recipe: 8 per group, single-output requests.
            n_samples_per_prompt=8,
            rollout_microgroup_size=1,
            generation_options=("num_frames", "fps"),
            default_sde_type="cps",
            # The reference trains LTX without classifier-free guidance, so rollouts sample
            # without it unless --diffusion-guidance-scale says otherwise.
            supports_cfg_training=False,
            default_guidance_scale=1.0,
        )
    ]
