"""The one place a run's model family is loaded.

The class is the registered family's (``--diffusion-model-family``, or matched from the
checkpoint's ``model_index.json`` and name by :mod:`miles_core.family_match` while the
configuration is resolved) or the ``--train-pipeline-config-path`` class; ``--model-backend-path``
replaces the loader; ``--sft-encoder-checkpoint`` supplies an SFT run's encoders. The
model goes to the machine's device (a GPU when one is visible) in
``--diffusion-forward-dtype``; ``--compile`` compiles its transformer's repeated blocks.
The embedded engine and the trainer both load through :func:`load_family`, so they
cannot disagree about what they run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from miles_core.machine import visible_gpu_count

if TYPE_CHECKING:
    import torch

    from miles_core.family import ModelFamily


def model_device() -> str:
    """``cuda`` when a GPU is visible, else ``cpu``. The noise generators stay on the CPU
    unless ``--diffusion-generator-device cuda`` puts them on this device (each request's
    ``generator_device``)."""
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
    """Load the configuration's model family (see the module docstring); under
    ``--vae-tiling`` its VAE tiles (:meth:`~miles_core.family.ModelFamily.enable_vae_tiling`); under
    ``--compile`` its trainable components' repeated blocks are compiled
    (:func:`compile_family`)."""
    return finish_family(config, _load_family(config))


def finish_family(config: Any, family: ModelFamily) -> ModelFamily:
    """What the configuration asks of a loaded family: ``--vae-tiling``, ``--compile``."""
    if config.get("vae_tiling"):
        family.enable_vae_tiling()
    if config.get("compile"):
        compile_family(family)
    return family


def compile_family(family: ModelFamily) -> dict[str, int]:
    """``--compile``: compile the repeated blocks of the family's trainable components in
    place (:mod:`miles_core.regional_compile`; lazy, so LoRA adapters a trainer adds
    later are compiled too); return each component's block count. A component without
    repeated blocks is a one-line :class:`~miles_core.errors.RunError`."""
    from miles_core.errors import RunError
    from miles_core.regional_compile import compile_components

    try:
        return compile_components(family.components())
    except ValueError as exc:
        raise RunError(str(exc)) from None


def _load_family(config: Any) -> ModelFamily:
    from miles_core.family import ModelFamily

    if config.model_backend_path:
        from miles_core.refs import load_hook

        hook = load_hook("--model-backend-path", config.model_backend_path, "model_backend")
        family = hook.fn(config)
        if not isinstance(family, ModelFamily):
            from miles_core.errors import RunError

            raise RunError(
                f"{hook.where}: must return a miles_core.family.ModelFamily instance (wrap a pipeline as "
                f"FamilyClass(pipeline, device=..., dtype=...)), got {type(family).__name__}"
            )
        return family
    if config.get("sft_encoder_checkpoint"):
        return load_sft_family(config)
    return family_class(config).from_pretrained(
        config.hf_checkpoint, device=model_device(), dtype=torch_dtype(config.diffusion_forward_dtype)
    )


# -- --sft-encoder-checkpoint: an SFT run's encoders from another pipeline ----------------

_ENCODER_PREFIXES = ("tokenizer", "text_encoder")


def encoder_components(pipeline_cls: type) -> list[str]:
    """The pipeline's tokenizers, text encoders and VAE(s), by ``__init__`` argument name
    (SD3: ``tokenizer``..``tokenizer_3``, ``text_encoder``..``text_encoder_3``, ``vae``)."""
    import inspect

    names = [name for name in inspect.signature(pipeline_cls.__init__).parameters if name != "self"]
    return [n for n in names if n.startswith(_ENCODER_PREFIXES) or n == "vae" or n.endswith("_vae")]


def load_sft_family(config: Any) -> Any:
    """The model family of an SFT run: ``--hf-checkpoint``'s pipeline, whose tokenizers,
    text encoders and VAE come from ``--sft-encoder-checkpoint`` when it is set (passed
    to diffusers' ``from_pretrained`` as component overrides, so the transformer
    checkpoint's own copies are never loaded and may be absent). The encoder checkpoint
    must be a local diffusers directory listing every such component in its
    ``model_index.json`` (``[null, null]`` there means "none", e.g. SD3 without T5) with
    a folder for each listed one; otherwise a one-line error names what is missing."""
    import json
    from pathlib import Path

    from miles_core.errors import RunError
    from miles_core.family import pipeline_class_for

    dtype = torch_dtype(config.diffusion_forward_dtype)
    device = model_device()
    family_cls = family_class(config)
    if not config.sft_encoder_checkpoint:
        return family_cls.from_pretrained(config.hf_checkpoint, device=device, dtype=dtype)
    flag = f"--sft-encoder-checkpoint {config.sft_encoder_checkpoint}"
    root = Path(config.sft_encoder_checkpoint)
    index_path = root / "model_index.json"
    if not index_path.is_file():
        raise RunError(f"{flag}: not a local diffusers pipeline directory (no model_index.json)")
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RunError(f"{flag}: unreadable model_index.json ({exc})".replace("\n", " ")) from None
    pipeline_cls = pipeline_class_for(family_cls, config.hf_checkpoint)
    wanted = encoder_components(pipeline_cls)
    absent = [n for n in wanted if isinstance(index.get(n), list) and index[n][:1] == [None]]
    missing = [n for n in wanted if n not in index or (n not in absent and not (root / n).is_dir())]
    if missing:
        raise RunError(f"{flag}: lacks {', '.join(missing)} (each of {', '.join(wanted)} needs a model_index.json entry and a folder)")
    # Load only the encoders: every other component the directory lists is passed as None.
    others = [n for n in index if not n.startswith("_") and n not in wanted]
    try:
        source = family_cls.load_pipeline(root, dtype=dtype, **{n: None for n in others})
    except (OSError, ValueError, TypeError) as exc:
        raise RunError(f"{flag}: cannot load its encoders ({type(exc).__name__}: {exc})".replace("\n", " ")) from None
    encoders = {n: getattr(source, n) for n in wanted}
    pipeline = family_cls.load_pipeline(config.hf_checkpoint, dtype=dtype, **encoders)
    return family_cls(pipeline, device=device, dtype=dtype)
