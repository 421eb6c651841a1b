"""The model-family contract (DESIGN section 4).

A family plugin registers a :class:`~miles_core.specs.ModelFamilySpec` whose ``ref``
names a :class:`ModelFamily` subclass. This module stays import-light: torch and
diffusers are imported inside the methods that need them, so resolving a family (for
example to read its native size while validating a configuration) loads no model code.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline


class ModelFamily:
    """Loading and tiny-pipeline building for one family of diffusers pipelines.

    Subclasses set :attr:`pipeline_class` and implement :meth:`build_tiny_pipeline`;
    they override :meth:`native_size` when the pipeline's default output size can be
    read from its configuration files.
    """

    pipeline_class: ClassVar[str]
    """The diffusers pipeline class, ``"diffusers:StableDiffusion3Pipeline"``."""

    @classmethod
    def resolve_pipeline_class(cls) -> type[DiffusionPipeline]:
        module_name, _, attr = cls.pipeline_class.partition(":")
        return getattr(importlib.import_module(module_name), attr)

    @classmethod
    def load_pipeline(cls, checkpoint: str | Path, *, torch_dtype: Any = None, **kwargs: Any) -> DiffusionPipeline:
        """Load the family's pipeline with ``from_pretrained`` from a local directory or
        hub id (``model_index.json`` layout)."""
        pipeline_cls = cls.resolve_pipeline_class()
        if torch_dtype is not None:
            kwargs["torch_dtype"] = torch_dtype
        return pipeline_cls.from_pretrained(str(checkpoint), **kwargs)

    @classmethod
    def build_tiny_pipeline(cls, out_dir: str | Path, *, seed: int = 0) -> Path:
        """Write a randomly initialised, tiny version of the family's real pipeline
        (real classes, tiny configs, locally built tokenizers; nothing downloaded) to
        ``out_dir`` with ``save_pretrained``, deterministically for a given ``seed``.
        Returns the directory. ``pipeline_class.from_pretrained(out_dir)`` loads it."""
        raise NotImplementedError(f"{cls.__name__} has no tiny pipeline factory")

    @classmethod
    def native_size(cls, checkpoint: str | Path) -> tuple[int, int] | None:
        """The ``(height, width)`` the pipeline produces when none is asked for, as
        diffusers resolves it, or ``None`` when it cannot be told without loading the
        model (for example a hub id). Reads only JSON files."""
        return None


def read_component_config(checkpoint: str | Path, component: str) -> dict[str, Any] | None:
    """``<checkpoint>/<component>/config.json`` as a dict, or ``None`` when the
    checkpoint is not a local diffusers directory."""
    path = Path(checkpoint) / component / "config.json"
    if not path.is_file():
        return None
    with path.open(encoding="utf-8") as handle:
        return json.load(handle)
