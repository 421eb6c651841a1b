"""One pipeline component built from its configuration file alone, as ``from_pretrained``
would build it but without reading a weight: diffusers models from ``config.json`` in the
load dtype (``_keep_in_fp32_modules`` in fp32), transformers models through
``_from_config``. On the meta device that is the real module tree, shapes and dtypes with no
data: what the memory planner counts (:mod:`miles_core.planning.meta_pipeline`) and what a
sharded trainer's ranks build before each materialises its own shard
(:mod:`miles_core.training.rank_loading`).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Iterator
from pathlib import Path

import torch

from miles_core.errors import CheckpointError


@contextlib.contextmanager
def quiet_logger(logger: str) -> Iterator[None]:
    """``logger`` at ERROR level inside the block."""
    log = logging.getLogger(logger)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def component_class(library: str, class_name: str, where: str) -> type:
    """The class a ``model_index.json`` entry ``[library, class_name]`` names; ``where``
    starts the one-line :class:`~miles_core.errors.CheckpointError` when there is none."""
    # model_index.json names a library ("diffusers", "transformers") or, for a class that
    # lives in a pipeline's own module, that module's name ("ltx2"), as diffusers reads it.
    for module_name in (library, f"diffusers.pipelines.{library}"):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        cls = getattr(module, class_name, None)
        if cls is not None:
            return cls
    raise CheckpointError(f"{where}: no class {class_name} in {library} or diffusers.pipelines.{library} as installed here")


def build_component(cls: type, folder: Path, dtype: torch.dtype, where: str, device: str | torch.device) -> torch.nn.Module:
    """``cls`` (a diffusers or transformers model class) from ``folder/config.json`` on
    ``device`` in ``dtype``, as ``from_pretrained`` would type it."""
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"{where}: no config.json, so the component cannot be built without loading it")
    if hasattr(cls, "load_config") and hasattr(cls, "from_config"):  # a diffusers model
        with torch.device(device), quiet_logger("diffusers"):
            # Quiet: .to(dtype) warns about _keep_in_fp32_modules (kept below), and a
            # published config's keys the installed class no longer takes are noted at load.
            model = cls.from_config(cls.load_config(folder))
            model.to(dtype)
        keep = set(getattr(cls, "_keep_in_fp32_modules", None) or ())
        for name, module in model.named_modules():
            if keep & set(name.split(".")):  # from_pretrained keeps these in fp32 whatever the load dtype
                module.to(torch.float32)
        return model
    import transformers

    with quiet_logger("transformers"):
        config = transformers.AutoConfig.from_pretrained(str(folder))
        with torch.device(device):
            return cls._from_config(config, dtype=dtype)


__all__ = ["build_component", "component_class", "quiet_logger"]
