"""A family's pipeline built from a checkpoint's configuration files alone, on the meta
device: every module has its real shapes and dtypes and no data, so a 20B transformer is
built in a second and no weight file is read (there may be none: the weightless real
configurations under each family plugin's ``tests/data/real_checkpoints``).

Components are built as ``from_pretrained`` would build them (diffusers models from their
``config.json`` in the load dtype, transformers models from theirs, schedulers from
``scheduler_config.json``); tokenizers and processors, which hold no tensors, are left out
(``None``): the planner never tokenizes (the family's :meth:`plan_conditioning
<miles_core.family.ModelFamily.plan_conditioning>` gives the encoders' outputs by shape).
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import torch

from miles_core.component_build import build_component, component_class
from miles_core.family_match import read_model_index


def build_pipeline_from_configs(
    checkpoint: str | Path, pipeline_cls: type, dtype: torch.dtype, extra: dict[str, Any] | None = None, *, device: str = "meta"
) -> Any:
    """``pipeline_cls`` over the components of ``checkpoint`` (a local diffusers
    directory) built on ``device`` in ``dtype`` (the meta device: shapes without data; a
    real device: randomly initialised weights, for checking the planner against a real
    run, :mod:`miles_core.planning.accuracy`); tokenizers and processors ``None`` unless
    ``extra`` gives them (:meth:`~miles_core.family.ModelFamily.plan_components`).
    A component the configuration cannot build is a one-line
    :class:`~miles_core.errors.CheckpointError` naming it."""
    directory = Path(checkpoint)
    index = read_model_index(directory)
    accepted = set(inspect.signature(pipeline_cls.__init__).parameters) - {"self"}
    components: dict[str, Any] = {}
    for name, entry in index.items():
        if name.startswith("_") or name not in accepted:
            continue
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2):
            components[name] = entry  # a pipeline setting (Wan's boundary_ratio, expand_timesteps)
            continue
        if entry[0] is None or entry[1] is None:
            components[name] = None
            continue
        library, class_name = entry
        where = f"--hf-checkpoint {directory}: component {name} ({library}.{class_name})"
        cls = component_class(library, class_name, where)
        folder = directory / name
        if isinstance(cls, type) and issubclass(cls, torch.nn.Module):
            components[name] = build_component(cls, folder, dtype, where, device)
        elif hasattr(cls, "from_config") and (folder / "scheduler_config.json").is_file():
            components[name] = cls.from_config(cls.load_config(folder))
        else:
            components[name] = None  # a tokenizer, processor or feature extractor: no tensors
    components.update(extra or {})
    for name, param in inspect.signature(pipeline_cls.__init__).parameters.items():
        if (
            name != "self"
            and name not in components
            and param.default is inspect.Parameter.empty
            and param.kind is param.POSITIONAL_OR_KEYWORD
        ):
            components[name] = None
    return pipeline_cls(**components)


__all__ = ["build_pipeline_from_configs"]
