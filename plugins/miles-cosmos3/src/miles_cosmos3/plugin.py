"""Entry point of the ``miles-cosmos3`` distribution (group ``miles.plugins``).

Registration only: importing this module must not import torch, diffusers or
transformers (``miles-core list-plugins`` reads it without loading model code).
"""

from __future__ import annotations

from miles_core.api import ModelFamilySpec, hookimpl


@hookimpl
def miles_register_model_families() -> list[ModelFamilySpec]:
    """The Cosmos 3 family."""
    return [
        ModelFamilySpec(
            name="cosmos3",
            ref="miles_cosmos3.family:Cosmos3Family",
            description=(
                "NVIDIA Cosmos 3 (Cosmos3OmniPipeline): text/token-conditioned image and video "
                "generation; only the transformer's generation path is trained"
            ),
            checkpoint_patterns=("cosmos3", "cosmos-3"),
            pipeline_classes=("Cosmos3OmniPipeline",),
            trainable_components=("transformer",),
            # The generation-path attention; to_q/to_k/to_v/to_out are the frozen understanding path.
            lora_target_modules=("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"),
            n_samples_per_prompt=16,
            # The transformer packs one sample with no batch dimension.
            rollout_microgroup_size=1,
            generation_options=("num_frames", "fps"),
            max_microgroup_size=1,
            sequence_parallel_refusal=(
                "its transformer packs two pathways (understanding and generation) of ragged lengths with grouped-query "
                "attention, which diffusers' context-parallel plans cannot express; diffusers ships no plan for it"
            ),
        )
    ]
