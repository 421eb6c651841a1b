"""Atomic, world-size-independent training checkpoints (``--save``/``--load``).

Layout of one checkpoint, ``root/iter_{rollout_id:07d}/``::

    meta.json                       format version, rollout id, component names, flags,
                                    the JSON part of ``extra`` and a manifest (bytes +
                                    sha256 of every other file)
    model/<component>.safetensors   full, unsharded tensors of each trained component
    optimizer.json                  optimizer structure: param_groups, scalar state
    optimizer.safetensors           optimizer tensors, flattened (``state.0.exp_avg``)
    rng.json / rng.safetensors      python, numpy, torch CPU (and CUDA) generator states
    extra.safetensors               only when ``extra`` holds tensors (an EMA shadow)

A sharded checkpoint (full fine-tuning on several ranks,
:mod:`~miles_core.training.sharded_checkpoint`) has no ``model/`` and no optimizer files:
``dcp/`` holds every rank's shards of the weights, optimizer state and EMA, and
``meta.json`` (format version 2) records them in its ``sharded`` record and manifest.

and ``root/latest_checkpointed_iteration.txt`` holds the id of the newest complete one
(the Megatron/Miles convention ``--ckpt-step`` defaults to).

Why this shape:

* No pickle anywhere. Tensors go to safetensors and everything else to JSON, so loading
  a checkpoint can never execute code, and the files are readable by other tools.
* World-size independence: the caller hands in full (gathered) tensors and nothing about
  ranks or shards is recorded, so a run saved on 8 GPUs resumes on 1 and vice versa (a
  sharded checkpoint reshards on load).
* Atomicity: everything is written and fsynced in a hidden temporary sibling directory,
  which is renamed into place in one step; ``latest`` is replaced (temp file +
  ``os.replace``) only afterwards. A crash at any moment leaves ``latest`` pointing at a
  complete checkpoint; the leftovers are hidden ``.iter_*`` directories that the next
  save of the same id removes.
* Rotation (``--save-keep-last``, :func:`rotate_checkpoints`) deletes old checkpoints only
  after the new one is published, renaming each out of the way before removing it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
import secrets
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from miles_core.errors import CheckpointError

FORMAT = "miles-core-checkpoint"
FORMAT_VERSION = 2
"""The newest format this module reads: 1 (unsharded) or 2 (sharded, :mod:`~miles_core.training.sharded_checkpoint`)."""
LATEST_FILE = "latest_checkpointed_iteration.txt"
SHARD_DIR = "dcp"
"""The folder of a sharded checkpoint's DCP files inside its iteration directory."""

_ITER_RE = re.compile(r"^iter_(\d{7,})$")
# Component names become file names; keep them to a safe, portable alphabet.
_COMPONENT_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
# Keys that mark encoded values in the JSON structure files.
_TAGS = ("__tensor__", "__tuple__", "__items__", "__float__")
_HASH_CHUNK = 4 << 20


@dataclass
class Checkpoint:
    """A loaded checkpoint. Tensors are on the CPU; ``optimizer_state`` is a state dict
    ready for ``optimizer.load_state_dict`` (None when saved with ``--no-save-optim``)."""

    rollout_id: int
    model_state: dict[str, dict[str, torch.Tensor]]
    optimizer_state: dict[str, Any] | None
    rng_state: dict[str, Any]
    extra: dict[str, Any]
    path: Path | None = None
    sharded: dict[str, Any] | None = None
    """``meta.json``'s ``sharded`` record when the weights, optimizer state and EMA are in
    ``path / "dcp"`` (``model_state`` is then empty and ``optimizer_state`` None)."""


# ---------------------------------------------------------------------------- JSON codec
# A small tagged encoding for the non-tensor parts. JSON alone loses tuples (AdamW's
# betas), int dict keys (optimizer state is keyed by parameter index) and non-finite
# floats; tensors are moved out into a flat dict (for safetensors) and referenced by key.


def _encode(obj: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        if path in tensors:
            raise ValueError(f"checkpoint: two tensors flatten to the same key {path!r}; avoid '.' in dict keys")
        # A private contiguous CPU copy: safetensors refuses views sharing storage, and
        # the copy must not change if training goes on while the file is written.
        tensors[path] = obj.detach().to("cpu", copy=True).contiguous()
        return {"__tensor__": path}
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return float(obj) if math.isfinite(obj) else {"__float__": repr(float(obj))}
    if hasattr(obj, "item") and type(obj).__module__ == "numpy":  # numpy scalars
        return _encode(obj.item(), path, tensors)
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, f"{path}.{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, f"{path}.{i}", tensors) for i, v in enumerate(obj)]
    if isinstance(obj, Mapping):

        def child(k: Any) -> str:
            return f"{path}.{k}" if path else str(k)

        if all(isinstance(k, str) and k not in _TAGS for k in obj):
            return {k: _encode(v, child(k), tensors) for k, v in obj.items()}
        for k in obj:
            if not isinstance(k, (str, int, bool, float, type(None))):
                raise TypeError(f"checkpoint: dict key {k!r} at {path or '<root>'!r} is not a JSON scalar")
        return {"__items__": [[_encode(k, "", {}), _encode(v, child(k), tensors)] for k, v in obj.items()]}
    raise TypeError(
        f"checkpoint: cannot store {type(obj).__name__} at {path or '<root>'!r} without pickle; "
        "use tensors, numbers, strings, lists, tuples and dicts"
    )


def _decode(obj: Any, tensors: Mapping[str, torch.Tensor], where: Path) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors, where) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1:
        ((tag, value),) = obj.items()
        if tag == "__tensor__":
            if value not in tensors:
                raise CheckpointError(f"{where}: refers to tensor {value!r}, which its .safetensors file lacks")
            return tensors[value]
        if tag == "__tuple__":
            return tuple(_decode(v, tensors, where) for v in value)
        if tag == "__items__":
            return {_decode(k, tensors, where): _decode(v, tensors, where) for k, v in value}
        if tag == "__float__":
            return float(value)
    return {k: _decode(v, tensors, where) for k, v in obj.items()}


def optimizer_state_to_tensors(state: Mapping[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Split ``optimizer.state_dict()`` into flat tensors (``state.<param_index>.exp_avg``,
    ``state.<param_index>.step``, ...) and a JSON-encodable structure (param_groups
    hyperparameters, non-tensor state) referencing them by key.

    Tensors keep their dtype (AdamW's float32 ``step`` included), so
    :func:`optimizer_state_from_tensors` gives back a state dict that continues the
    optimizer bit for bit."""
    tensors: dict[str, torch.Tensor] = {}
    structure = _encode(dict(state), "", tensors)
    return tensors, structure


def optimizer_state_from_tensors(tensors: Mapping[str, torch.Tensor], structure: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`optimizer_state_to_tensors`: a state dict for
    ``optimizer.load_state_dict``."""
    return _decode(dict(structure), tensors, Path("<optimizer state>"))


def trainer_optimizer_state(trainer: Any) -> dict[str, Any]:
    """The full, index-keyed optimizer state of ``trainer``: its ``optimizer_state()``
    (gathered from the shards under FSDP2, a collective), or ``optimizer.state_dict()``
    for a trainer-like object without one."""
    method = getattr(trainer, "optimizer_state", None)
    return method() if callable(method) else trainer.optimizer.state_dict()


def load_trainer_optimizer_state(trainer: Any, state: Mapping[str, Any]) -> None:
    """Load a full optimizer state saved at any world size into ``trainer``: its
    ``load_optimizer_state`` (each rank keeps its shard under FSDP2), or
    ``optimizer.load_state_dict`` for a trainer-like object without one."""
    method = getattr(trainer, "load_optimizer_state", None)
    if callable(method):
        method(state)
    else:
        trainer.optimizer.load_state_dict(state)


# ---------------------------------------------------------------------------- RNG


def capture_rng() -> dict[str, Any]:
    """The state of every generator training draws from: python ``random``, numpy's
    global generator, torch's CPU generator and, when CUDA is available, each device's.
    Python and numpy states are plain JSON values; torch states are uint8 tensors."""
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss_next},
        "torch_cpu": torch.get_rng_state(),
    }
    try:
        import numpy as np
    except ImportError:  # numpy is optional; nothing to capture without it
        np = None  # type: ignore[assignment]
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {
            "bit_generator": str(name),
            "state": [int(k) for k in keys],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    if torch.cuda.is_available():
        state["torch_cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Put back the generator states of :func:`capture_rng` (as loaded from a checkpoint).

    CUDA states are restored for as many devices as both the saved run and this process
    have: a resume on fewer or more GPUs is allowed (world-size independence), the extra
    devices keep their own seeds."""
    if "python" in state:
        py = state["python"]
        random.setstate((int(py["version"]), tuple(int(v) for v in py["state"]), py["gauss_next"]))
    if "torch_cpu" in state:
        torch.set_rng_state(torch.as_tensor(state["torch_cpu"], dtype=torch.uint8).cpu())
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:
            np = None  # type: ignore[assignment]
        if np is not None:
            npst = state["numpy"]
            np.random.set_state(
                (
                    npst["bit_generator"],
                    np.asarray(npst["state"], dtype=np.uint32),
                    int(npst["pos"]),
                    int(npst["has_gauss"]),
                    float(npst["cached_gaussian"]),
                )
            )
    cuda_states = state.get("torch_cuda")
    if cuda_states and torch.cuda.is_available():
        for device, cuda_state in enumerate(list(cuda_states)[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(torch.as_tensor(cuda_state, dtype=torch.uint8).cpu(), device)


# ---------------------------------------------------------------------------- file helpers


def iteration_dir(root: Path, rollout_id: int) -> Path:
    """``root/iter_{rollout_id:07d}``."""
    return Path(root) / f"iter_{int(rollout_id):07d}"


def _fsync_path(path: Path, *, directory: bool = False) -> None:
    # Data must reach the disk before the rename that publishes it, or a power loss could
    # leave a published checkpoint with empty files.
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        if directory:  # some platforms cannot open directories; durability is best effort there
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not directory:
            raise
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, allow_nan=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, str(path), metadata={"format": "pt"})
    _fsync_path(path)


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------- save


def new_temporary(root: Path, rollout_id: int) -> Path:
    """Create the hidden temporary directory a save of ``rollout_id`` writes into
    (removing the debris of an earlier crashed save of that id); it becomes
    ``iter_{rollout_id:07d}`` when :func:`save_checkpoint` publishes it."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = iteration_dir(root, int(rollout_id))
    # Only this id: another id's temporary directory may belong to a save still running elsewhere.
    for stale in root.glob(f".{final.name}.tmp-*"):
        _remove_tree(stale)
    tmp = root / f".{final.name}.tmp-{secrets.token_hex(4)}"  # secrets, not random: the RNG state is being saved
    tmp.mkdir()
    return tmp


def discard_temporary(tmp: Path) -> None:
    """Remove a temporary directory of :func:`new_temporary` whose save failed."""
    _remove_tree(Path(tmp))


def save_checkpoint(
    root: Path,
    rollout_id: int,
    *,
    model_state: Mapping[str, Mapping[str, torch.Tensor]],
    optimizer_state: Mapping[str, Any] | None,
    rng_state: Mapping[str, Any],
    extra: Mapping[str, Any],
    temporary: Path | None = None,
    sharded: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``root/iter_{rollout_id:07d}/`` atomically, then point
    ``root/latest_checkpointed_iteration.txt`` at it; return the checkpoint directory.

    Args:
        model_state: component name -> full (unsharded) tensors, e.g. the LoRA weights
            or the full weights of each trained component.
        optimizer_state: ``optimizer.state_dict()``, or None for ``--no-save-optim``.
        rng_state: :func:`capture_rng`.
        extra: JSON-like values (optimizer_steps, use_lora, ...); tensors inside, such as
            an ``EMA.state_dict()``, go to ``extra.safetensors``.
        temporary: a directory of :func:`new_temporary` that already holds files (the
            ranks' shards); the save writes into it and publishes it.
        sharded: the :class:`~miles_core.training.sharded_checkpoint.ShardedPart` record
            of the shards in ``temporary`` (its files join the manifest); ``model_state``
            and ``optimizer_state`` are then empty.

    An existing checkpoint of the same id is replaced: the new one is complete on disk
    before the old one is renamed away, and the old one is deleted only once the new one
    is in place (if a crash hits between the two renames, readers fall back to the old
    one, see :func:`latest_iteration`).
    """
    root = Path(root)
    rollout_id = int(rollout_id)
    if rollout_id < 0:
        raise ValueError(f"save_checkpoint: rollout_id must be >= 0, got {rollout_id}")
    for name, tensors in model_state.items():
        if not _COMPONENT_RE.match(name):
            raise ValueError(f"save_checkpoint: component name {name!r} is not usable as a file name")
        for key, value in tensors.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"save_checkpoint: model_state[{name!r}][{key!r}] is {type(value).__name__}, not a tensor")
    # Encode the JSON parts before touching the disk so a bad value fails without leftovers.
    rng_tensors: dict[str, torch.Tensor] = {}
    rng_structure = _encode(dict(rng_state), "", rng_tensors)
    extra_tensors: dict[str, torch.Tensor] = {}
    extra_structure = _encode(dict(extra), "", extra_tensors)

    if sharded is not None and (temporary is None or model_state or optimizer_state is not None):
        raise ValueError("save_checkpoint: a sharded save passes its temporary directory and no model or optimizer state")
    final = iteration_dir(root, rollout_id)
    tmp = Path(temporary) if temporary is not None else new_temporary(root, rollout_id)
    old: Path | None = None
    try:
        files: list[str] = []
        if sharded is None:
            (tmp / "model").mkdir()
        for name, tensors in model_state.items():
            cpu = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}
            write_tensors(tmp / "model" / f"{name}.safetensors", cpu)
            del cpu  # one component's copy in memory at a time
            files.append(f"model/{name}.safetensors")
        if sharded is None:
            _fsync_path(tmp / "model", directory=True)
        if optimizer_state is not None:
            opt_tensors, opt_structure = optimizer_state_to_tensors(optimizer_state)
            write_tensors(tmp / "optimizer.safetensors", opt_tensors)
            _write_json(tmp / "optimizer.json", opt_structure)
            files += ["optimizer.safetensors", "optimizer.json"]
        write_tensors(tmp / "rng.safetensors", rng_tensors)
        _write_json(tmp / "rng.json", rng_structure)
        files += ["rng.safetensors", "rng.json"]
        if extra_tensors:
            write_tensors(tmp / "extra.safetensors", extra_tensors)
            files.append("extra.safetensors")
        meta = {
            "format": FORMAT,
            "format_version": 1 if sharded is None else 2,
            "rollout_id": rollout_id,
            "components": list(model_state) if sharded is None else list(sharded["components"]),
            "has_optimizer": optimizer_state is not None if sharded is None else sharded.get("optimizer") is not None,
            "extra": extra_structure,
            "files": {f: {"bytes": (tmp / f).stat().st_size, "sha256": _sha256(tmp / f)} for f in files},
        }
        if sharded is not None:
            # The ranks hashed their own files; the driver does not read the shards.
            meta["files"].update(sharded["files"])
            meta["sharded"] = {k: v for k, v in sharded.items() if k != "files"}
        _write_json(tmp / "meta.json", meta)  # last: a directory with meta.json has all its files
        _fsync_path(tmp, directory=True)

        if final.exists():
            old = root / f".{final.name}.old-{secrets.token_hex(4)}"
            os.rename(final, old)
        os.rename(tmp, final)
        _fsync_path(root, directory=True)
    except BaseException:
        if old is not None and not final.exists():
            try:  # put the previous checkpoint back; if this fails too, readers fall back to it
                os.rename(old, final)
            except OSError:
                pass
        _remove_tree(tmp)
        raise
    if old is not None:
        _remove_tree(old)
    for stale in root.glob(f".{final.name}.old-*"):  # from an earlier crash between the renames
        _remove_tree(stale)

    latest_tmp = root / f".{LATEST_FILE}.tmp-{secrets.token_hex(4)}"
    try:
        with open(latest_tmp, "w", encoding="utf-8") as f:
            f.write(f"{rollout_id}\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(latest_tmp, root / LATEST_FILE)
    except BaseException:
        latest_tmp.unlink(missing_ok=True)
        raise
    _fsync_path(root, directory=True)
    return final


# ---------------------------------------------------------------------------- load


def _read_meta(directory: Path) -> dict[str, Any]:
    """The validated meta.json of a checkpoint directory, or CheckpointError. Checks the
    manifest's files exist with their recorded sizes (cheap); hashes are left to load."""
    meta_path = directory / "meta.json"
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    if not meta_path.is_file():
        raise CheckpointError(f"{directory}: incomplete checkpoint, meta.json is missing")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{meta_path}: unreadable ({type(e).__name__}: {e})".replace("\n", " ")) from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{meta_path}: not a {FORMAT} meta file")
    if not isinstance(meta.get("format_version"), int) or meta["format_version"] > FORMAT_VERSION:
        raise CheckpointError(f"{meta_path}: format version {meta.get('format_version')!r}; this miles-core reads up to {FORMAT_VERSION}")
    for name, info in meta.get("files", {}).items():
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"{path}: missing from the checkpoint")
        size = path.stat().st_size
        if size != info.get("bytes"):
            raise CheckpointError(f"{path}: {size} bytes, the manifest records {info.get('bytes')} (truncated or replaced)")
    return meta


def _resolve(root: Path, rollout_id: int) -> Path:
    """The directory holding checkpoint ``rollout_id``: ``iter_*`` itself, or, after a
    crash between the two renames of a same-id replacement, the complete old copy that
    was renamed away."""
    final = iteration_dir(root, rollout_id)
    if final.exists():
        return final
    for old in sorted(root.glob(f".{final.name}.old-*")):
        try:
            _read_meta(old)
            return old
        except CheckpointError:
            continue
    return final


def available_iterations(root: Path) -> list[int]:
    """The ids of the complete checkpoints under ``root``, ascending."""
    root = Path(root)
    if not root.is_dir():
        return []
    found: set[int] = set()
    for entry in root.iterdir():
        m = _ITER_RE.match(entry.name) or re.match(r"^\.(iter_\d{7,})\.old-", entry.name)
        if m is None:
            continue
        rollout_id = int(m.group(1).removeprefix("iter_"))
        try:
            _read_meta(_resolve(root, rollout_id))
        except CheckpointError:
            continue
        found.add(rollout_id)
    return sorted(found)


def _available_text(root: Path) -> str:
    ids = available_iterations(root)
    return f"available: {', '.join(map(str, ids))}" if ids else "no complete checkpoint there"


def latest_iteration(root: Path) -> int | None:
    """The id in ``root/latest_checkpointed_iteration.txt``; None when the file does not
    exist (nothing saved yet). CheckpointError when it is unreadable or names a checkpoint
    that is missing or incomplete."""
    root = Path(root)
    path = root / LATEST_FILE
    if not path.exists():
        return None
    try:
        text = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable ({type(e).__name__}: {e})".replace("\n", " ")) from e
    if not text.isdigit():
        raise CheckpointError(f"{path}: holds {text[:40]!r}, not an iteration number")
    rollout_id = int(text)
    try:
        _read_meta(_resolve(root, rollout_id))
    except CheckpointError as e:
        raise CheckpointError(f"{path} names iteration {rollout_id}, but {e} ({_available_text(root)})") from e
    return rollout_id


def _load_tensors(path: Path, info: Mapping[str, Any] | None, verify: bool) -> dict[str, torch.Tensor]:
    if info is None:
        raise CheckpointError(f"{path}: not listed in meta.json's manifest")
    if verify and _sha256(path) != info.get("sha256"):
        raise CheckpointError(f"{path}: sha256 differs from meta.json's manifest (corrupt file)")
    try:
        return load_file(str(path), device="cpu")
    except Exception as e:  # safetensors raises its own error types for bad headers/data
        raise CheckpointError(f"{path}: corrupt safetensors file ({type(e).__name__}: {e})".replace("\n", " ")) from e


def _load_json(path: Path, info: Mapping[str, Any] | None, verify: bool) -> Any:
    if info is None:
        raise CheckpointError(f"{path}: not listed in meta.json's manifest")
    if verify and _sha256(path) != info.get("sha256"):
        raise CheckpointError(f"{path}: sha256 differs from meta.json's manifest (corrupt file)")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt JSON ({type(e).__name__}: {e})".replace("\n", " ")) from e


def load_checkpoint(root: Path, step: int | None = None, *, verify: bool = True) -> Checkpoint:
    """Load checkpoint ``step`` (``--ckpt-step``) from ``root``; ``None`` means the one
    ``latest_checkpointed_iteration.txt`` names.

    ``verify`` checks every file against the sha256 in meta.json, catching bit rot and
    partial copies that a size check would miss. Any problem raises a one-line
    :class:`CheckpointError` naming the path."""
    root = Path(root)
    if step is None:
        step = latest_iteration(root)
        if step is None:
            raise CheckpointError(f"{root / LATEST_FILE}: not found, nothing to resume from ({_available_text(root)})")
    directory = _resolve(root, int(step))
    if not directory.exists():
        raise CheckpointError(f"{directory}: no checkpoint for step {step} ({_available_text(root)})")
    meta = _read_meta(directory)
    if meta.get("rollout_id") != int(step):
        raise CheckpointError(f"{directory / 'meta.json'}: records rollout_id {meta.get('rollout_id')!r}, expected {step}")
    files: dict[str, Any] = meta.get("files", {})

    model_state = {
        name: _load_tensors(directory / "model" / f"{name}.safetensors", files.get(f"model/{name}.safetensors"), verify)
        for name in ([] if "sharded" in meta else meta.get("components", []))
    }
    optimizer_state = None
    if meta.get("has_optimizer") and "sharded" not in meta:
        opt_tensors = _load_tensors(directory / "optimizer.safetensors", files.get("optimizer.safetensors"), verify)
        opt_structure = _load_json(directory / "optimizer.json", files.get("optimizer.json"), verify)
        optimizer_state = _decode(opt_structure, opt_tensors, directory / "optimizer.json")
    rng_tensors = _load_tensors(directory / "rng.safetensors", files.get("rng.safetensors"), verify)
    rng_state = _decode(_load_json(directory / "rng.json", files.get("rng.json"), verify), rng_tensors, directory / "rng.json")
    extra_tensors: dict[str, torch.Tensor] = {}
    if "extra.safetensors" in files:
        extra_tensors = _load_tensors(directory / "extra.safetensors", files["extra.safetensors"], verify)
    extra = _decode(meta.get("extra", {}), extra_tensors, directory / "meta.json")
    sharded = None
    if "sharded" in meta:
        if not isinstance(meta["sharded"], dict):
            raise CheckpointError(f"{directory / 'meta.json'}: malformed 'sharded' record")
        sharded = {**meta["sharded"], "files": {k: v for k, v in files.items() if k.startswith(f"{SHARD_DIR}/")}}
    return Checkpoint(
        rollout_id=int(step),
        model_state=model_state,
        optimizer_state=optimizer_state,
        rng_state=rng_state,
        extra=extra,
        path=directory,
        sharded=sharded,
    )


def read_extra(root: Path, step: int | None = None) -> dict[str, Any] | None:
    """The JSON part of checkpoint ``step``'s ``extra`` (``None``: the latest), read from
    its ``meta.json`` alone, without loading any tensor: keys whose values hold tensors
    (an EMA shadow) are left out. None when ``step`` is None and nothing was saved yet
    (``latest_checkpointed_iteration.txt`` absent), as a resumed run treats it."""
    root = Path(root)
    if step is None:
        step = latest_iteration(root)
        if step is None:
            return None
    directory = _resolve(root, int(step))
    if not directory.exists():
        raise CheckpointError(f"{directory}: no checkpoint for step {step} ({_available_text(root)})")
    extra = _read_meta(directory).get("extra", {})
    return {k: _decode(v, {}, directory / "meta.json") for k, v in extra.items() if not _holds_tensor(v)}


def rotate_checkpoints(root: Path, keep: int, *, newest: int, protect: Iterable[int] = ()) -> list[int]:
    """``--save-keep-last``: delete the complete checkpoints under ``root`` older than the
    ``keep`` newest of those up to ``newest`` (the one just published); return their ids.

    ``newest`` itself and the ids in ``protect`` (the checkpoint the run resumed from) are
    never deleted, nor are checkpoints above ``newest`` (left by an earlier run that went
    further; ``latest`` no longer names them). Call it only after ``newest`` is published.
    Each checkpoint is first renamed to a hidden ``.iter_*.del-*`` name, which no reader
    takes for a checkpoint, then removed; the debris of an interrupted deletion goes on the
    next call."""
    if keep < 1:
        raise ValueError(f"rotate_checkpoints: keep must be >= 1, got {keep}")
    root = Path(root)
    for debris in root.glob(".iter_*.del-*"):
        _remove_tree(debris)
    ids = [i for i in available_iterations(root) if i <= newest]
    kept = set(ids[-keep:]) | {int(newest)} | {int(i) for i in protect}
    deleted: list[int] = []
    for rollout_id in ids:
        if rollout_id in kept:
            continue
        final = iteration_dir(root, rollout_id)
        for directory in [final, *sorted(root.glob(f".{final.name}.old-*"))]:
            if directory.exists():
                trash = root / f".{final.name}.del-{secrets.token_hex(4)}"
                os.rename(directory, trash)
                _remove_tree(trash)
        deleted.append(rollout_id)
    if deleted:
        _fsync_path(root, directory=True)
    return deleted


def _holds_tensor(obj: Any) -> bool:
    if isinstance(obj, list):
        return any(_holds_tensor(v) for v in obj)
    if isinstance(obj, dict):
        return "__tensor__" in obj or any(_holds_tensor(v) for v in obj.values())
    return False


__all__ = [
    "FORMAT_VERSION",
    "LATEST_FILE",
    "Checkpoint",
    "SHARD_DIR",
    "CheckpointError",
    "available_iterations",
    "capture_rng",
    "discard_temporary",
    "iteration_dir",
    "latest_iteration",
    "load_checkpoint",
    "load_trainer_optimizer_state",
    "new_temporary",
    "optimizer_state_from_tensors",
    "optimizer_state_to_tensors",
    "read_extra",
    "restore_rng",
    "rotate_checkpoints",
    "save_checkpoint",
    "trainer_optimizer_state",
]
