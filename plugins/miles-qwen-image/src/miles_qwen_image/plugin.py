"""Entry-point module (``miles.plugins``): registers the Qwen-Image family.

Import-light on purpose: only miles-core's public API, no torch, diffusers or
transformers, so plugin discovery stays cheap.
"""

from __future__ import annotations

from miles_core.api import ModelFamilySpec, hookimpl

LORA_TARGET_MODULES: tuple[str, ...] = (
    # joint attention: image stream, then text stream
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
    # image and text MLPs of every block (GELU-approximate FeedForward: net.0.proj in, net.2 out)
    "img_mlp.net.0.proj",
    "img_mlp.net.2",
    "txt_mlp.net.0.proj",
    "txt_mlp.net.2",
)
"""Module-name suffixes (as PEFT matches them) of the reference's default LoRA targets."""


@hookimpl
def miles_register_model_families() -> list[ModelFamilySpec]:
    """The ``qwen_image`` family."""
    return [
        ModelFamilySpec(
            name="qwen_image",
            ref="miles_qwen_image.family:QwenImageFamily",
            description="Qwen-Image text-to-image (diffusers QwenImagePipeline, true CFG)",
            checkpoint_patterns=("qwen-image",),
            pipeline_classes=("QwenImagePipeline",),
            trainable_components=("transformer",),
            lora_target_modules=LORA_TARGET_MODULES,
            n_samples_per_prompt=16,
            rollout_microgroup_size=8,
            generation_options=("true_cfg_scale",),
        )
    ]
