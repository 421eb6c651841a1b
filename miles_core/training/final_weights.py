"""The trained weights a run exports at its end, written by the training ranks
themselves (under ``--use-ray`` no other process holds them): a diffusers LoRA
(``out/lora``) or each trained component in diffusers' layout (``out/model/<name>``).

Every rank calls :func:`save_final_weights` together (gathers are collectives under
FSDP2); only the writer (rank 0) writes.

- LoRA: the family's ``save_lora`` on the writer's modules. Under FSDP2 the ranks gather
  the adapters first (small), and while the LoRA is written each module's
  ``state_dict()`` answers those whole tensors (FSDP2's own state dict hands out shards).
- Full fine-tuning: an unsharded component is written by ``save_pretrained``; a sharded
  one is streamed by :func:`stream_component`: the ranks gather one tensor at a time and
  the writer fills diffusers' sharded safetensors files (at most ``max_shard_bytes``
  each, with their index and the component's ``config.json``), which ``from_pretrained``
  loads. No process holds more than one file's worth of gathered weights.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

SAFETENSORS_NAME = "diffusion_pytorch_model.safetensors"
"""diffusers' weights file of a component (``…-00001-of-0000N.safetensors`` when split)."""
INDEX_NAME = SAFETENSORS_NAME + ".index.json"
MAX_SHARD_BYTES = 10 * 10**9
"""The largest file :func:`stream_component` writes: ``save_pretrained``'s default (10GB)."""


def save_final_weights(trainer: Any, out: Path, *, writes: bool, max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """Write ``trainer``'s trained weights under ``out`` (``writes``: this rank writes;
    every rank must call it, see the module docstring)."""
    modules = trainer.modules
    if trainer.config.use_lora:
        if trainer.mesh is None:
            if writes:
                trainer.family.save_lora(out / "lora", modules)
            return
        state = trainer.trainable_state()  # the adapters, gathered on every rank
        if writes:
            with _answering_state_dicts(modules, state, trainer.engine_dtypes):
                trainer.family.save_lora(out / "lora", modules)
        return
    for name, module in modules.items():
        directory = out / "model" / name
        if trainer.mesh is None:
            if writes:
                module.save_pretrained(str(directory))
        else:
            stream_component(module, directory, trainer.engine_dtypes[name], writes=writes, max_shard_bytes=max_shard_bytes)


@contextmanager
def _answering_state_dicts(
    modules: Mapping[str, torch.nn.Module], state: Mapping[str, Mapping[str, torch.Tensor]], dtypes: Mapping[str, Mapping[str, Any]]
) -> Iterator[None]:
    """Within it, each module's ``state_dict()`` returns its gathered trainable tensors
    (in the dtypes an unsharded module holds), which is all a LoRA writer reads."""
    for name, module in modules.items():
        whole = {key: tensor.to(dtypes[name].get(key, tensor.dtype)) for key, tensor in state[name].items()}
        module.state_dict = lambda *args, _whole=whole, **kwargs: dict(_whole)  # an instance attribute, removed below
    try:
        yield
    finally:
        for module in modules.values():
            del module.state_dict


def stream_component(
    module: torch.nn.Module, directory: Path, dtypes: Mapping[str, torch.dtype], *, writes: bool, max_shard_bytes: int = MAX_SHARD_BYTES
) -> None:
    """Write ``module`` (sharded or not) as ``save_pretrained`` lays it out: its state
    dict gathered one tensor at a time (collective under FSDP2) in the dtypes of
    ``dtypes`` (parameter name -> dtype; others keep theirs), into files of at most
    ``max_shard_bytes`` (a larger tensor gets a file of its own)."""
    from safetensors.torch import save_file

    from miles_core.training.fsdp import full_tensor

    state = module.state_dict()  # FSDP2: the shards, under the plain module's names
    target = {name: dtypes.get(name, tensor.dtype) for name, tensor in state.items()}
    sizes = {name: tensor.numel() * target[name].itemsize for name, tensor in state.items()}
    groups: list[list[str]] = []
    filled = 0
    for name in state:
        if not groups or (groups[-1] and filled + sizes[name] > max_shard_bytes):
            groups.append([])
            filled = 0
        groups[-1].append(name)
        filled += sizes[name]
    count = len(groups)
    files = [SAFETENSORS_NAME] if count == 1 else [f"diffusion_pytorch_model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    if writes:
        directory.mkdir(parents=True, exist_ok=True)
        save_config = getattr(module, "save_config", None)
        if callable(save_config):
            save_config(str(directory))
    weight_map: dict[str, str] = {}
    for group, filename in zip(groups, files):
        tensors = {name: full_tensor(state[name]).to(target[name]).contiguous() for name in group}
        if writes:
            save_file(tensors, str(directory / filename), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(group, filename))
        del tensors
    if writes and count > 1:
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        (directory / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")


__all__ = ["INDEX_NAME", "MAX_SHARD_BYTES", "SAFETENSORS_NAME", "save_final_weights", "stream_component"]
