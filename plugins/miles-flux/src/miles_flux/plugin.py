"""Entry-point module (``miles.plugins``): registers the FLUX family and checks its flags.

Import-light on purpose: only miles-core's public API and the JSON reader of
:mod:`miles_flux.checkpoint`, no torch, diffusers or transformers, so plugin discovery
stays cheap.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from miles_core.api import ModelFamilySpec, hookimpl
from miles_flux.checkpoint import KLEIN, read_checkpoint

FAMILY_NAME = "flux"

LORA_TARGET_MODULES: tuple[str, ...] = (
    # FLUX.1 double-stream blocks: joint attention, image stream then text stream (the
    # single-stream blocks' attn.to_q/k/v match too)
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    # and their MLPs (GELU FeedForward: net.0.proj in, net.2 out)
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
)
"""FLUX.1's default LoRA targets, module-name suffixes as PEFT matches them: flow_grpo's
twelve (scripts/train_flux.py)."""

KLEIN_LORA_TARGET_MODULES: tuple[str, ...] = (
    # FLUX.2 double-stream blocks: the same joint attention ...
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    # ... SwiGLU MLPs of both streams ...
    "ff.linear_in",
    "ff.linear_out",
    "ff_context.linear_in",
    "ff_context.linear_out",
    # ... and the single-stream blocks' fused QKV + MLP input projection (their output
    # projection is added by block: klein_lora_targets).
    "attn.to_qkv_mlp_proj",
)
"""FLUX.2 [klein]'s default LoRA targets by suffix: the same roles as FLUX.1's (attention
and MLPs of every double block) under FLUX.2's layer names, plus the single blocks' fused
input projection. No published RL recipe names them (our choice)."""

SINGLE_BLOCK_OUTPUT = "single_transformer_blocks.{index}.attn.to_out"
"""A single-stream block's attention output projection, by block: the suffix
``attn.to_out`` alone would also name the double blocks' ``attn.to_out``, a ModuleList
(projection and dropout) that PEFT cannot wrap."""

DEFAULT_GUIDANCE_SCALE = 3.5
"""``FluxPipeline.__call__``'s default guidance (the embedded value FLUX.1 [dev] was
distilled around), and flow_grpo's FLUX sampling guidance."""

KLEIN_GUIDANCE_SCALE = 4.0
"""``Flux2KleinPipeline.__call__``'s default ``guidance_scale`` (diffusers 0.42, as in
Black Forest Labs' model card examples): real CFG on the undistilled [klein] base; the
step-distilled release ignores it."""


def klein_lora_targets(directory: Path, model_index: dict[str, Any]) -> tuple[str, ...] | None:
    """A local FLUX.2 [klein] directory's default LoRA targets (``lora_target_modules_for``):
    :data:`KLEIN_LORA_TARGET_MODULES` plus each single-stream block's attention output by
    block-qualified name, as many as ``transformer/config.json``'s ``num_single_layers``;
    None for the other pipelines, or a configuration that does not give the depth (the
    static defaults)."""
    path = Path(directory) / "transformer" / "config.json"
    if model_index.get("_class_name") != KLEIN or not path.is_file():
        return None
    count = json.loads(path.read_text(encoding="utf-8")).get("num_single_layers")
    if count is None:
        return None  # a configuration without the depth: the suffixes alone
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"transformer/config.json: num_single_layers {count!r} is not a count of blocks")
    return (*KLEIN_LORA_TARGET_MODULES, *(SINGLE_BLOCK_OUTPUT.format(index=i) for i in range(count)))


@hookimpl
def miles_register_model_families() -> list[ModelFamilySpec]:
    """The ``flux`` family."""
    return [
        ModelFamilySpec(
            name=FAMILY_NAME,
            ref="miles_flux.family:FluxFamily",
            description="FLUX.1 [dev] and FLUX.2 [klein] text-to-image (diffusers FluxPipeline, Flux2KleinPipeline; guidance-distilled)",
            checkpoint_patterns=("flux",),
            pipeline_classes=("FluxPipeline", "Flux2KleinPipeline", "Flux2Pipeline"),
            trainable_components=("transformer",),
            lora_target_modules=LORA_TARGET_MODULES,
            lora_target_modules_by_pipeline=((KLEIN, KLEIN_LORA_TARGET_MODULES),),
            lora_target_modules_for="miles_flux.plugin:klein_lora_targets",
            n_samples_per_prompt=24,
            rollout_microgroup_size=8,
            default_guidance_scale=DEFAULT_GUIDANCE_SCALE,
            default_guidance_scale_by_pipeline=((KLEIN, KLEIN_GUIDANCE_SCALE),),
            generation_options=("true_cfg_scale",),
        )
    ]


@hookimpl
def miles_validate_config(config: Any) -> list[str]:
    """The FLUX rules the command line can break, checked before anything loads: sizes
    that the 2x2 packing cannot split, a FLUX.2 [klein] checkpoint given FLUX.1 [dev]'s
    true-CFG option, and CFG parallelism on a guidance-distilled checkpoint."""
    from miles_flux.config_rules import config_errors

    if getattr(config, "model_family", None) != FAMILY_NAME:
        return []
    checkpoint = read_checkpoint(getattr(config, "hf_checkpoint", "") or "")
    return config_errors(config, checkpoint)


__all__ = [
    "DEFAULT_GUIDANCE_SCALE",
    "FAMILY_NAME",
    "KLEIN_GUIDANCE_SCALE",
    "KLEIN_LORA_TARGET_MODULES",
    "LORA_TARGET_MODULES",
    "SINGLE_BLOCK_OUTPUT",
    "klein_lora_targets",
]
