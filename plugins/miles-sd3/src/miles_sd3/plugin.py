"""Entry-point module of miles-sd3 (group ``miles.plugins``, name ``sd3``).

Registration only: it imports nothing heavy, so plugin discovery never loads torch,
diffusers or transformers. The family class is referenced lazily by ``ref``.
"""

from __future__ import annotations

from miles_core.api import ModelFamilySpec, hookimpl

SD3_LORA_TARGETS: tuple[str, ...] = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
)
"""Joint-attention projections of every MMDiT block (image and text streams). SD3.5's
second, image-only attention (``attn2.*``) is deliberately not matched."""


@hookimpl
def miles_register_model_families() -> list[ModelFamilySpec]:
    """Register the ``sd3`` family (SD3 and SD3.5 checkpoints)."""
    return [
        ModelFamilySpec(
            name="sd3",
            ref="miles_sd3.family:SD3Family",
            description="Stable Diffusion 3 / 3.5 (StableDiffusion3Pipeline, MMDiT transformer)",
            checkpoint_patterns=("stable-diffusion-3", "sd3"),
            pipeline_classes=("StableDiffusion3Pipeline",),
            trainable_components=("transformer",),
            lora_target_modules=SD3_LORA_TARGETS,
            n_samples_per_prompt=16,
            rollout_microgroup_size=8,
        )
    ]
