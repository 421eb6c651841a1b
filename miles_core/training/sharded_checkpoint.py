"""Sharded checkpoints of full fine-tuning on several ranks, with ``torch.distributed.checkpoint``.

Full fine-tuning of a large model cannot gather its weights, its Adam moments and its EMA
into one process (a 20B model: about 240 GB in fp32). At a world size above 1 without
``--use-lora``, each rank therefore writes its own shards (DCP, one file per rank) into
the iteration directory's ``dcp/`` folder, and nothing is gathered. The rest of the
checkpoint (``meta.json`` with its manifest, the RNG states, the schedule, the JSON
``extra``) is the one :mod:`~miles_core.training.checkpoint` writes, by the driver, into
the same temporary directory, which is published only after every rank has finished
(see :func:`save_sharded_checkpoint`). LoRA runs keep the single small unsharded file.

What ``dcp/`` holds, all tensors keyed by the fully qualified names of
:meth:`~miles_core.training.trainer.Trainer.named_trainable` (``transformer.<param>``):

    model.<fqn>            the trainable weights (the master weights, in their dtype)
    optim.<fqn>.<key>      the optimizer's per-parameter state (``exp_avg``, ``step``, ...)
    ema.<fqn>              the EMA shadow, float32, sharded like the weights

The optimizer's ``param_groups`` (hyperparameters, with parameter names instead of
indices), the EMA's last step and the manifest of the DCP files (bytes and sha256, each
rank hashing its share of the files) travel in ``meta.json``'s ``sharded`` record.

Loading reshards: DCP reads into whatever layout the loading trainer has, sharded
parameters at any world size or plain tensors in one process without a process group.
Before anything is read, the files are checked against the manifest (each rank hashes its
share), the DCP metadata is read without executing code (an allow-listed unpickler: DCP
pickles its metadata) and the saved names and shapes must be this run's trainable
parameters. Every function here that takes a trainer is a collective under FSDP2: every
rank calls it, in the same order.
"""

from __future__ import annotations

import io
import os
import pickle
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from miles_core.errors import CheckpointError
from miles_core.training.checkpoint import SHARD_DIR

_METADATA = ".metadata"

# DCP's metadata file is a pickle of these records (torch 2.x); anything else is refused.
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


def uses_sharded_checkpoints(config: Any) -> bool:
    """Whether ``config``'s checkpoints are sharded: full fine-tuning at a world size above 1."""
    return int(getattr(config, "world_size", 1) or 1) > 1 and not getattr(config, "use_lora", False)


@dataclass
class ShardedPart:
    """What the ranks report after writing their shards; stored as ``meta.json``'s
    ``sharded`` record (:meth:`to_record`)."""

    files: dict[str, dict[str, Any]]
    """``dcp/<file>`` -> ``{"bytes", "sha256"}``, every file the ranks wrote."""
    model_keys: list[str]
    """The trainable parameters' names, ``component.parameter``."""
    world_size: int
    """The world size that wrote the shards (informative: loading reshards)."""
    optimizer: dict[str, Any] | None = None
    """``{"param_groups": ..., "scalars": ...}`` as tagged JSON, None without optimizer state."""
    ema_last_step: int | None = None
    """The EMA's last step, None when the run keeps no EMA."""
    components: list[str] = field(default_factory=list)

    def to_record(self) -> dict[str, Any]:
        return {
            "files": self.files,
            "model_keys": self.model_keys,
            "world_size": self.world_size,
            "optimizer": self.optimizer,
            "ema_last_step": self.ema_last_step,
            "components": self.components,
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any], where: Path) -> ShardedPart:
        try:
            return cls(
                files=dict(record["files"]),
                model_keys=list(record["model_keys"]),
                world_size=int(record["world_size"]),
                optimizer=record.get("optimizer"),
                ema_last_step=record.get("ema_last_step"),
                components=list(record.get("components", [])),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{where}: malformed 'sharded' record ({type(exc).__name__}: {exc})") from None


# ---------------------------------------------------------------------------- collectives


def _active() -> bool:
    from miles_core.training import fsdp

    return fsdp.is_active()


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    return (dist.get_rank(), dist.get_world_size()) if _active() else (0, 1)


def _gather(obj: Any) -> list[Any]:
    from miles_core.training import fsdp

    return fsdp.all_gather_object(obj)


def _raise_first(errors: list[str | None]) -> None:
    """The same one-line error on every rank when any rank found one (no rank is left
    waiting in a later collective)."""
    for error in errors:
        if error:
            raise CheckpointError(error)


# ---------------------------------------------------------------------------- save


def _named(trainer: Any) -> dict[str, torch.Tensor]:
    """The tensors the optimizer steps, under :meth:`Trainer.named_trainable`'s names: the
    master copies where a one-process trainer keeps them (``--fsdp-master-dtype``), else
    the parameters (always under FSDP2, whose shards are the master weights)."""
    named = getattr(trainer, "named_masters", None)
    return named() if callable(named) else trainer.named_trainable()


def _fqn_of(trainer: Any) -> dict[int, str]:
    return {id(p): name for name, p in _named(trainer).items()}


def _optimizer_order(trainer: Any) -> list[torch.Tensor]:
    """The optimizer's parameters in ``state_dict()`` index order."""
    return [p for group in trainer.optimizer.param_groups for p in group["params"]]


def _sharded_state(trainer: Any, *, optimizer: bool) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """The flat DCP state of this rank (DTensors stay sharded: nothing is gathered) and
    the optimizer's JSON part."""
    from miles_core.training.checkpoint import optimizer_state_to_tensors

    named = _named(trainer)
    state: dict[str, torch.Tensor] = {f"model.{name}": p.detach() for name, p in named.items()}
    optim_json: dict[str, Any] | None = None
    if optimizer:
        fqn_of = _fqn_of(trainer)
        scalars: dict[str, dict[str, Any]] = {}
        for p in _optimizer_order(trainer):
            name = fqn_of[id(p)]
            for key, value in trainer.optimizer.state.get(p, {}).items():
                if torch.is_tensor(value):
                    state[f"optim.{name}.{key}"] = value
                else:
                    scalars.setdefault(name, {})[key] = value
        groups = [
            {**{k: v for k, v in group.items() if k != "params"}, "params": [fqn_of[id(p)] for p in group["params"]]}
            for group in trainer.optimizer.param_groups
        ]
        tensors, structure = optimizer_state_to_tensors({"param_groups": groups, "scalars": scalars})
        if tensors:
            raise TypeError("sharded checkpoint: tensors in the optimizer's param_groups are not supported")
        optim_json = structure
    if trainer.ema is not None:
        for name, shadow in trainer.ema.shadow.items():
            state[f"ema.{name}"] = shadow
    return state, optim_json


def _sha256(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(4 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def write_shards(trainer: Any, directory: Path, *, optimizer: bool = True) -> ShardedPart:
    """Write this rank's shards of ``trainer``'s weights, optimizer state (``optimizer``)
    and EMA into ``directory`` (new or empty; on a filesystem every rank sees) and
    return what was written, the same on every rank. Collective under FSDP2."""
    import torch.distributed.checkpoint as dcp

    directory = Path(directory)
    rank, world = _rank_and_world()
    state, optim_json = _sharded_state(trainer, optimizer=optimizer)
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
    _gather(None)  # the folder exists before any rank writes into it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming a single process" without a group
        dcp.save(
            state,
            storage_writer=dcp.FileSystemWriter(directory, single_file_per_rank=True, sync_files=True, overwrite=False),
            no_dist=not _active(),
        )
    # Every rank has written (DCP's save ends with the coordinator's metadata); each
    # hashes its share of the files rather than one process reading them all.
    names = _gather(sorted(os.listdir(directory)) if rank == 0 else None)[0]
    mine = {
        f"{SHARD_DIR}/{name}": {"bytes": (directory / name).stat().st_size, "sha256": _sha256(directory / name)}
        for name in names[rank::world]
    }
    files: dict[str, dict[str, Any]] = {}
    for part in _gather(mine):
        files.update(part)
    keys = list(_named(trainer))
    return ShardedPart(
        files=dict(sorted(files.items())),
        model_keys=keys,
        world_size=world,
        optimizer=optim_json,
        ema_last_step=None if trainer.ema is None else int(trainer.ema.last_step),
        components=list(dict.fromkeys(key.split(".", 1)[0] for key in keys)),
    )


def save_sharded_checkpoint(
    root: Path,
    rollout_id: int,
    write: Callable[[Path], ShardedPart],
    *,
    rng_state: Mapping[str, Any],
    extra: Mapping[str, Any],
) -> Path:
    """The driver's side of a sharded save: make the temporary iteration directory, let
    ``write(tmp / "dcp")`` have every rank write its shards (and return their
    :class:`ShardedPart`), then write the driver's files and publish the directory and
    the latest pointer (:func:`~miles_core.training.checkpoint.save_checkpoint`). A save
    that fails or is killed before the publication leaves only a hidden temporary
    directory, which is never loaded."""
    from miles_core.training.checkpoint import discard_temporary, new_temporary, save_checkpoint

    tmp = new_temporary(root, rollout_id)
    try:
        part = write(tmp / SHARD_DIR)
    except BaseException:
        discard_temporary(tmp)
        raise
    return save_checkpoint(
        root,
        rollout_id,
        model_state={},
        optimizer_state=None,
        rng_state=rng_state,
        extra=extra,
        temporary=tmp,
        sharded=part.to_record(),
    )


# ---------------------------------------------------------------------------- load


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing {module}.{name}, which DCP metadata does not contain")


def read_metadata(directory: Path) -> Any:
    """DCP's metadata of ``directory``, unpickled with an allow-list (never executes
    code); a missing or foreign file is a :class:`CheckpointError`."""
    path = Path(directory) / _METADATA
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"{path}: unreadable sharded checkpoint metadata ({type(exc).__name__}: {exc})") from None
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # a corrupt pickle raises assorted types
        raise CheckpointError(f"{path}: not DCP metadata ({type(exc).__name__}: {exc})".replace("\n", " ")) from None
    if type(metadata).__name__ != "Metadata" or not isinstance(getattr(metadata, "state_dict_metadata", None), dict):
        raise CheckpointError(f"{path}: not DCP metadata")
    return metadata


def _reader(directory: Path) -> Any:
    import torch.distributed.checkpoint as dcp

    class SafeReader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = read_metadata(directory)
            from torch.distributed.checkpoint.metadata import StorageMeta

            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(directory)


def _check_files(directory: Path, files: Mapping[str, Mapping[str, Any]], *, verify: bool) -> None:
    """Every rank checks that every file exists with its recorded size, and hashes its
    share of them (collective); the first problem is raised on every rank."""
    rank, world = _rank_and_world()
    error: str | None = None
    names = sorted(files)
    for name in names:
        path = directory.parent / name
        if not path.is_file():
            error = f"{path}: missing from the sharded checkpoint"
            break
        if path.stat().st_size != files[name].get("bytes"):
            error = f"{path}: {path.stat().st_size} bytes, the manifest records {files[name].get('bytes')} (truncated or replaced)"
            break
    if error is None and verify:
        for name in names[rank::world]:
            if _sha256(directory.parent / name) != files[name].get("sha256"):
                error = f"{directory.parent / name}: sha256 differs from meta.json's manifest (corrupt shard)"
                break
    if error is None and f"{SHARD_DIR}/{_METADATA}" not in files:
        error = f"{directory / _METADATA}: not in meta.json's manifest (partial sharded checkpoint)"
    _raise_first(_gather(error))


def _check_model_keys(trainer: Any, metadata: Any, part: ShardedPart) -> dict[str, torch.Tensor]:
    named = _named(trainer)
    saved = {key.removeprefix("model.") for key in metadata.state_dict_metadata if key.startswith("model.")}
    if saved != set(part.model_keys):
        raise CheckpointError("the DCP metadata's weights differ from meta.json's list (mixed or partial checkpoint)")
    for component in dict.fromkeys(name.split(".", 1)[0] for name in [*named, *saved]):
        here = {n for n in named if n.split(".", 1)[0] == component}
        there = {n for n in saved if n.split(".", 1)[0] == component}
        if here != there:
            raise ValueError(
                f"the checkpoint's {component} weights do not match this run's trainable parameters "
                f"({len(there)} saved, {len(here)} here): same --use-lora / LoRA settings?"
            )
    for name, p in named.items():
        size = tuple(metadata.state_dict_metadata[f"model.{name}"].size)
        if size != tuple(p.shape):
            raise ValueError(f"the checkpoint's {name} has shape {size}, this run's {tuple(p.shape)}")
    return named


def read_shards(trainer: Any, directory: Path, part: ShardedPart, *, optimizer: bool = True, verify: bool = True) -> None:
    """Load a sharded checkpoint's ``dcp/`` folder into ``trainer`` at its own world size:
    weights, optimizer state (``optimizer``, when saved) and EMA (when the trainer keeps
    one). Collective under FSDP2; in one process it needs no process group.

    Problems with the files (missing, truncated, corrupt, foreign metadata) are
    :class:`CheckpointError`; a checkpoint of other trainable parameters is a ``ValueError``."""
    import torch.distributed.checkpoint as dcp

    directory = Path(directory)
    if not directory.is_dir():
        _raise_first(_gather(f"{directory}: missing (partial sharded checkpoint)"))
    _check_files(directory, part.files, verify=verify)
    metadata = read_metadata(directory)
    named = _check_model_keys(trainer, metadata, part)
    if trainer.ema is not None and part.ema_last_step is None:
        raise ValueError("this run keeps an EMA but the checkpoint has none")
    targets: dict[str, torch.Tensor] = {f"model.{name}": p.detach() for name, p in named.items()}
    entries: dict[str, dict[str, torch.Tensor]] = {}
    if optimizer and part.optimizer is not None:
        for key, md in metadata.state_dict_metadata.items():
            if not key.startswith("optim."):
                continue
            name, _, state_key = key.removeprefix("optim.").rpartition(".")
            if name not in named:
                raise ValueError(f"the checkpoint's optimizer state names {name}, which this run does not train")
            param = named[name]
            size = tuple(md.size)
            if size == tuple(param.shape):
                target = torch.zeros_like(param.detach(), dtype=md.properties.dtype)
            elif size == ():
                target = torch.zeros((), dtype=md.properties.dtype)
            else:
                raise ValueError(f"optimizer state {state_key!r} of {name} has shape {size}, the parameter {tuple(param.shape)}")
            entries.setdefault(name, {})[state_key] = target
            targets[key] = target
    if trainer.ema is not None:
        for name, shadow in trainer.ema.shadow.items():
            targets[f"ema.{name}"] = shadow
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(targets, storage_reader=_reader(directory), no_dist=not _active())
    except CheckpointError:
        raise
    except Exception as exc:  # DCP wraps every rank's failure in its own exception types
        raise CheckpointError(f"{directory}: unreadable sharded checkpoint ({type(exc).__name__}: {exc})".replace("\n", " ")) from None
    masters = getattr(trainer, "masters", None)
    if masters is not None:  # the parameters take the loaded master weights' rounding
        masters.copy_to_model()
    if optimizer and part.optimizer is not None:
        _load_optimizer(trainer, part.optimizer, entries)
    if trainer.ema is not None:
        trainer.ema.last_step = int(part.ema_last_step or 0)


def _load_optimizer(trainer: Any, structure: Mapping[str, Any], entries: dict[str, dict[str, torch.Tensor]]) -> None:
    from miles_core.training.checkpoint import optimizer_state_from_tensors

    saved = optimizer_state_from_tensors({}, structure)
    fqn_of = _fqn_of(trainer)
    order = [fqn_of[id(p)] for p in _optimizer_order(trainer)]
    index = {name: i for i, name in enumerate(order)}
    groups = saved["param_groups"]
    saved_order = [name for group in groups for name in group["params"]]
    if saved_order != order:
        raise ValueError("the checkpoint's optimizer parameter groups list other parameters than this run's optimizer")
    state: dict[int, dict[str, Any]] = {}
    for name, values in entries.items():
        state[index[name]] = dict(values)
    for name, values in dict(saved.get("scalars", {})).items():
        state.setdefault(index[name], {}).update(values)
    trainer.optimizer.load_state_dict(
        {"state": state, "param_groups": [{**group, "params": [index[n] for n in group["params"]]} for group in groups]}
    )


__all__ = [
    "SHARD_DIR",
    "ShardedPart",
    "read_metadata",
    "read_shards",
    "save_sharded_checkpoint",
    "uses_sharded_checkpoints",
    "write_shards",
]
