"""The one place a run's model family is loaded.

The class is the registered family's (``--diffusion-model-family`` or matched from the
checkpoint name) or the ``--train-pipeline-config-path`` class; ``--model-backend-path``
replaces the loader; ``--sft-encoder-checkpoint`` supplies an SFT run's encoders. The
model goes to the machine's device (a GPU when one is visible) in
``--diffusion-forward-dtype``. The embedded engine and the trainer both load through
:func:`load_family`, so they cannot disagree about what they run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from miles_core.machine import visible_gpu_count

if TYPE_CHECKING:
    import torch

    from miles_core.family import ModelFamily


def model_device() -> str:
    """``cuda`` when a GPU is visible, else ``cpu`` (noise generators stay on the CPU
    either way: ``--diffusion-generator-device``)."""
    return "cuda" if visible_gpu_count() else "cpu"


def torch_dtype(name: str) -> torch.dtype:
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def family_class(config: Any) -> type[ModelFamily]:
    """The family class the configuration selects."""
    if config.train_pipeline_config_path:
        from miles_core.refs import resolve_path_flag

        return resolve_path_flag("--train-pipeline-config-path", config.train_pipeline_config_path, "model_family")
    from miles_core.plugin_manager import get_host

    return get_host().registries.model_family.get(config.model_family).load()


def load_family(config: Any) -> ModelFamily:
    """Load the configuration's model family (see the module docstring)."""
    from miles_core.family import ModelFamily

    if config.model_backend_path:
        from miles_core.rollout.hooks import load_hook

        hook = load_hook("--model-backend-path", config.model_backend_path, "model_backend")
        family = hook.fn(config)
        if not isinstance(family, ModelFamily):
            from miles_core.training.run import RunError

            raise RunError(
                f"{hook.where}: must return a miles_core.family.ModelFamily instance (wrap a pipeline as "
                f"FamilyClass(pipeline, device=..., dtype=...)), got {type(family).__name__}"
            )
        return family
    if config.get("sft_encoder_checkpoint"):
        from miles_core.training.sft import load_sft_family

        return load_sft_family(config)
    return family_class(config).from_pretrained(
        config.hf_checkpoint, device=model_device(), dtype=torch_dtype(config.diffusion_forward_dtype)
    )
