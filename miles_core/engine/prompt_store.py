"""Prompt encodings computed once per run (``--precompute-prompt-embeddings``).

A :class:`PromptStore` holds the :class:`~miles_core.family.Conditioning` of every
distinct ``(prompt, negative prompt, resolved params)`` a run will request, each made by
the family's own ``encode`` with batch 1, exactly the call the engine makes per request,
so a stored encoding is the tensor an engine would compute. Entries live on disk under a
cache folder, one safetensors file each, in a sub-folder named by the encoding's
fingerprint (:func:`encoder_fingerprint`: the checksums of every frozen module an encode
may run, the tokenizers' vocabularies, the family's settings and code, dtype and device);
the file name hashes that fingerprint and the conditioning inputs. Each file carries a
SHA-256 of its tensors: an entry that cannot be read, does not check out, or was written
for other inputs is rebuilt with a one-line notice, never used; one that cannot be
written is kept in memory only.

Once the store is complete, :meth:`PromptStore.free_encoders` moves the text encoders'
weights to the meta device (their memory is released; the modules and their configs stay,
as some families read them when resolving a request) and makes the family's ``encode``
answer from the store: a prompt that is not in it raises :class:`PromptNotStoredError`
naming the prompt and the flag. Freeing cannot be undone: that family cannot encode, or
build a store, again (a one-line :class:`~miles_core.errors.RunError`); load the pipeline
again for that.

serve-engine takes the same store at start-up from a manifest the run writes
(``serve-engine --prompt-embeddings FILE``, :func:`write_manifest` / :func:`read_manifest`):
the requests to encode and the cache folder.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import inspect
import json
import os
import struct
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from miles_core.errors import PromptNotStoredError, RequestError, RunError
from miles_core.family import Conditioning, GenerationParams, ModelFamily
from miles_core.request import RolloutRequest
from miles_core.weights import module_checksum, named_tensors_checksum

FORMAT = 1
"""Version of the entry and manifest layout; part of every fingerprint."""
FLAG = "--precompute-prompt-embeddings"

Key = tuple[str, str | None, str]
"""``(prompt, negative_prompt, repr(params))``: the ConditioningCache's key too."""
Log = Callable[[str], None]


def conditioning_key(prompt: str, negative_prompt: str | None, params: GenerationParams) -> Key:
    return (prompt, negative_prompt, repr(params))


def text_encoders(family: ModelFamily) -> dict[str, torch.nn.Module]:
    """The pipeline's text encoders: its ``text_encoder*`` modules (what freeing releases)."""
    return {
        name: value
        for name, value in family.pipeline.components.items()
        if name.startswith("text_encoder") and isinstance(value, torch.nn.Module)
    }


def frozen_modules(family: ModelFamily) -> dict[str, torch.nn.Module]:
    """The pipeline modules an encoding may run: every one that is neither a trainable
    component (``family.components()``) nor a VAE. That is the text encoders and whatever
    else a family's ``encode`` calls (LTX-2's ``connectors``); a frozen module that encode
    does not run (a vocoder) only costs its checksum."""
    trainable = family.components()
    trainable_ids = {id(module) for module in trainable.values()}
    return {
        name: value
        for name, value in family.pipeline.components.items()
        if isinstance(value, torch.nn.Module) and name not in trainable and id(value) not in trainable_ids and "vae" not in name
    }


def fingerprinted_modules(family: ModelFamily) -> dict[str, torch.nn.Module]:
    """The modules :func:`encoder_fingerprint` covers: :func:`frozen_modules`, and the VAE
    too for a family that takes a conditioning image (its ``encode`` runs the VAE on the
    image, so a stored encoding depends on the VAE's weights)."""
    modules = frozen_modules(family)
    if getattr(family, "image_input", "none") != "none":
        trainable_ids = {id(module) for module in family.components().values()}
        for name, value in family.pipeline.components.items():
            if "vae" in name and isinstance(value, torch.nn.Module) and id(value) not in trainable_ids:
                modules[name] = value
    return modules


def tensor_bytes(modules: Iterable[torch.nn.Module]) -> int:
    """Bytes of the parameters and buffers of ``modules`` that hold memory (not meta)."""
    return sum(t.numel() * t.element_size() for m in modules for t in (*m.parameters(), *m.buffers()) if not t.is_meta)


def encoders_freed(family: ModelFamily) -> bool:
    """Whether a store already freed this family's text encoders (it cannot encode again)."""
    freed = any(t.is_meta for m in text_encoders(family).values() for t in m.parameters())
    return freed or "encode" in vars(family)


def _tokenizer_digest(tokenizer: Any) -> str:
    digest = hashlib.sha256(type(tokenizer).__qualname__.encode())
    vocab = getattr(tokenizer, "get_vocab", None)
    if callable(vocab):
        digest.update(json.dumps(vocab(), sort_keys=True).encode())
    for name in ("model_max_length", "padding_side", "truncation_side"):
        digest.update(f"{name}={getattr(tokenizer, name, None)!r}".encode())
    return digest.hexdigest()


def _module_digest(module: torch.nn.Module) -> str:
    """A frozen module as an encoding sees it: its class, its config (keys without a leading
    underscore: those carry the checkpoint's path and library versions), its parameters'
    checksum (:func:`~miles_core.weights.module_checksum`) and its buffers' (rotary
    tables and the like)."""
    config = getattr(module, "config", None)
    if hasattr(config, "to_dict"):  # transformers' configs; diffusers' is a dict
        config = config.to_dict()
    settings = {k: v for k, v in config.items() if not str(k).startswith("_")} if isinstance(config, dict) else None
    head = json.dumps([f"{type(module).__module__}.{type(module).__qualname__}", settings], sort_keys=True, default=repr)
    return hashlib.sha256(f"{head}|{module_checksum(module)}|{named_tensors_checksum(module.named_buffers())}".encode()).hexdigest()


_SCALARS = (str, int, float, bool, type(None))


def _settings(family: ModelFamily) -> dict[str, Any]:
    """The family's public scalar settings as the instance sees them (class defaults such
    as ``default_negative_prompt`` or ``max_sequence_length``, or an instance's override),
    read without running properties."""
    settings = {}
    for name in dir(family):
        if name.startswith("_"):
            continue
        value = inspect.getattr_static(family, name)
        if isinstance(value, _SCALARS) or (isinstance(value, tuple) and all(isinstance(v, _SCALARS) for v in value)):
            settings[name] = value
    return settings


@functools.cache
def package_owners() -> Mapping[str, list[str]]:
    """Top-level package -> distributions (a scan of every installed one: once per process)."""
    return importlib.metadata.packages_distributions()


def _source_file(cls: type) -> str | None:
    try:
        return inspect.getsourcefile(cls)
    except TypeError:  # a built-in class
        return None


def _code_digest(family: ModelFamily, modules: Iterable[torch.nn.Module]) -> dict[str, Any]:
    """What the encoding's code is: the SHA-256 of the source files of the family's classes
    (its whole MRO) and of the family module's folder, and the version of each
    distribution that provides the family, the pipeline's and the modules' classes, and torch."""
    cls = type(family)
    files = {c.__module__: _source_file(c) for c in cls.__mro__ if c is not object}
    own = files.get(cls.__module__)
    if own is not None:  # the family's helpers next to it (named by module, not path: a cache may move)
        package = cls.__module__.rpartition(".")[0]
        files.update({f"{package}/{f.name}": str(f) for f in Path(own).parent.glob("*.py")})
    sources = {name: hashlib.sha256(Path(f).read_bytes()).hexdigest() for name, f in sorted(files.items()) if f and Path(f).is_file()}
    packages = {c.__module__.split(".")[0] for c in cls.__mro__ if c is not object}
    packages.update(type(m).__module__.split(".")[0] for m in (family.pipeline, *modules))
    packages.add("torch")
    owners = package_owners()
    versions = {}
    for dist in sorted({d for p in packages for d in owners.get(p, ())}):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return {"sources": sources, "versions": versions}


def encoder_fingerprint(family: ModelFamily) -> str:
    """SHA-256 over what an encoding depends on besides its inputs, so that any change to
    it gives another fingerprint: the family class, its dtype and device type and public
    scalar settings, every frozen module it may run (:func:`fingerprinted_modules`: the
    text encoders and the like, and the VAE of a family that encodes a conditioning image;
    class, config, weights and buffers, :func:`_module_digest`), each tokenizer's vocabulary and length
    settings, and the code (:func:`_code_digest`). A family whose text encoders a store
    already freed is refused (:class:`~miles_core.errors.RunError` naming the flag)."""
    if encoders_freed(family):
        raise RunError(
            f"{FLAG}: the text encoders of this {type(family).__name__} were freed by an earlier prompt store, "
            "so it cannot encode again; load the pipeline again"
        )
    modules = fingerprinted_modules(family)
    digest = hashlib.sha256()
    head = {"format": FORMAT, "family": f"{type(family).__module__}.{type(family).__qualname__}"}
    head.update(dtype=str(family.dtype), device=family.device.type, settings=_settings(family), code=_code_digest(family, modules.values()))
    digest.update(json.dumps(head, sort_keys=True, default=repr).encode())
    for name, module in sorted(modules.items()):
        digest.update(f"{name}:{_module_digest(module)}".encode())
    components = family.pipeline.components
    for name in sorted(n for n in components if n.startswith("tokenizer") and components[n] is not None):
        digest.update(f"{name}:{_tokenizer_digest(components[name])}".encode())
    return digest.hexdigest()


def _tensors(cond: Conditioning) -> dict[str, torch.Tensor]:
    tensors = {f"positive.{k}": v for k, v in cond.positive.items()}
    tensors.update({f"negative.{k}": v for k, v in (cond.negative or {}).items()})
    return {k: v.detach().cpu().contiguous() for k, v in tensors.items()}


def _conditioning(tensors: dict[str, torch.Tensor], device: torch.device) -> Conditioning:
    positive = {k.split(".", 1)[1]: v.to(device) for k, v in tensors.items() if k.startswith("positive.")}
    negative = {k.split(".", 1)[1]: v.to(device) for k, v in tensors.items() if k.startswith("negative.")}
    return Conditioning(positive, negative or None)


def tensors_checksum(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over names, shapes, dtypes and raw bytes."""
    layout = json.dumps({k: [list(v.shape), str(v.dtype)] for k, v in sorted(tensors.items())})
    return hashlib.sha256((layout + named_tensors_checksum(tensors.items())).encode()).hexdigest()


def _metadata(fingerprint: str, key: Key) -> dict[str, str]:
    prompt, negative, params = key
    return {"format": str(FORMAT), "fingerprint": fingerprint, "prompt": prompt, "negative_prompt": json.dumps(negative), "params": params}


def entry_path(folder: Path, fingerprint: str, key: Key) -> Path:
    name = hashlib.sha256(json.dumps([FORMAT, fingerprint, *key]).encode()).hexdigest()
    return folder / fingerprint[:16] / f"{name}.safetensors"


class CorruptEntry(Exception):
    """A cache entry that must not be used (why: the message)."""


def read_entry(path: Path, fingerprint: str, key: Key) -> dict[str, torch.Tensor] | None:
    """The tensors of the entry at ``path``; None when there is none; :class:`CorruptEntry`
    when it cannot be parsed, its checksum fails or it was written for other inputs."""
    from safetensors.torch import load

    try:
        data = path.read_bytes()
    except (FileNotFoundError, NotADirectoryError):  # no entry (a file in the folder's place: writing reports it)
        return None
    except OSError as exc:
        raise CorruptEntry(f"unreadable ({exc.strerror or exc})") from None
    try:
        (size,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + size])
        metadata = header.get("__metadata__") or {}
        tensors = load(data)
    except Exception:  # struct, json and safetensors each raise their own for a damaged file
        raise CorruptEntry("not a readable safetensors file") from None
    expected = _metadata(fingerprint, key)
    if {k: metadata.get(k) for k in expected} != expected:
        raise CorruptEntry("written for other inputs")
    if metadata.get("checksum") != tensors_checksum(tensors):
        raise CorruptEntry("checksum mismatch")
    return tensors


def write_entry(path: Path, fingerprint: str, key: Key, tensors: dict[str, torch.Tensor]) -> None:
    """Write atomically (a reader never sees half a file); an ``OSError`` leaves no partial file."""
    from safetensors.torch import save

    metadata = {**_metadata(fingerprint, key), "checksum": tensors_checksum(tensors)}
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial.write_bytes(save(tensors, metadata=metadata))
        os.replace(partial, path)
    except OSError:
        try:
            partial.unlink(missing_ok=True)
        except OSError:
            pass  # the folder itself is the problem; the caller reports the first error
        raise


@dataclass
class BuildStats:
    encoded: int = 0
    loaded: int = 0
    rebuilt: int = 0
    unwritten: int = 0
    """Encodings that could not be written to the cache (kept in memory only)."""
    encode_s: float = 0.0
    """Seconds spent in the family's ``encode``."""
    total_s: float = 0.0
    """Seconds to build the store: fingerprint, loads, encodes and writes."""


class PromptStore:
    """The encodings of one run's prompts (see the module docstring)."""

    def __init__(self, family: ModelFamily, entries: dict[Key, Conditioning], folder: Path, stats: BuildStats) -> None:
        self.family = family
        self.entries = entries
        self.folder = folder
        self.stats = stats
        self.freed_bytes = 0

    @classmethod
    def build(cls, family: ModelFamily, requests: Iterable[RolloutRequest], folder: str | Path, *, log: Log) -> PromptStore:
        """Encode (or load from ``folder``) the conditioning of every distinct request, as
        the engine resolves it (``family.resolve_params``). A corrupt entry is rebuilt with
        a one-line notice through ``log``; an entry that cannot be written is kept in memory
        only (one notice, the first such file). A family whose text encoders a store freed
        is refused (:func:`encoder_fingerprint`)."""
        start = time.perf_counter()
        folder = Path(folder)
        fingerprint = encoder_fingerprint(family)
        entries: dict[Key, Conditioning] = {}
        stats = BuildStats()
        for request in requests:
            params = family.resolve_params(request)
            key = conditioning_key(request.prompt, request.negative_prompt, params)
            if key in entries:
                continue
            path = entry_path(folder, fingerprint, key)
            try:
                tensors = read_entry(path, fingerprint, key)
            except CorruptEntry as exc:
                log(f"{FLAG}: cache entry {path} for prompt {request.prompt!r} is corrupt ({exc}); rebuilt")
                stats.rebuilt += 1
                tensors = None
            if tensors is not None:
                stats.loaded += 1
                entries[key] = _conditioning(tensors, family.device)
                continue
            began = time.perf_counter()
            with torch.no_grad():
                cond = family.encode(request.prompt, request.negative_prompt, params)
            stats.encode_s += time.perf_counter() - began
            stats.encoded += 1
            try:
                write_entry(path, fingerprint, key, _tensors(cond))
            except OSError as exc:  # a full disk or a read-only cache must not end the run
                if not stats.unwritten:
                    log(f"{FLAG}: cannot write cache entry {path} ({exc.strerror or exc}); encodings not written are kept in memory only")
                stats.unwritten += 1
            entries[key] = cond
        stats.total_s = time.perf_counter() - start
        return cls(family, entries, folder, stats)

    def get(self, prompt: str, negative_prompt: str | None, params: GenerationParams) -> Conditioning:
        cond = self.entries.get(conditioning_key(prompt, negative_prompt, params))
        if cond is None:
            raise PromptNotStoredError(prompt, negative_prompt, FLAG)
        return cond

    @property
    def nbytes(self) -> int:
        """Bytes of the stored encodings."""
        return sum(
            t.numel() * t.element_size() for c in self.entries.values() for part in (c.positive, c.negative or {}) for t in part.values()
        )

    def free_encoders(self) -> int:
        """Release the text encoders' weights (moved to the meta device) and make the
        family's ``encode`` answer from this store from now on; returns the bytes freed."""
        encoders = text_encoders(self.family)
        freed = tensor_bytes(encoders.values())
        with torch.no_grad():
            for module in encoders.values():
                module.to("meta")
        # An instance attribute shadows the method: every caller (engine, trainer,
        # evaluation, checks) now gets a stored encoding or a one-line error, never the
        # output of a freed encoder.
        self.family.encode = self.get  # type: ignore[method-assign]
        if self.family.device.type == "cuda" and torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.freed_bytes = freed
        return freed


# -- the manifest serve-engine reads ------------------------------------------------------


def write_manifest(path: str | Path, folder: str | Path, requests: Iterable[RolloutRequest]) -> Path:
    """The requests to encode and the cache folder, as JSON (requests in the wire's JSON form)."""
    path = Path(path)
    document = {"format": FORMAT, "cache": str(Path(folder).absolute()), "requests": [r.to_json() for r in requests]}
    path.write_text(json.dumps(document), encoding="utf-8")
    return path


def read_manifest(path: str | Path) -> tuple[Path, list[RolloutRequest]]:
    """The cache folder and requests of a manifest; ``ValueError`` naming the problem."""
    try:
        document = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read the prompt-embeddings manifest: {exc}") from None
    shape_ok = isinstance(document, dict) and isinstance(document.get("cache"), str) and isinstance(document.get("requests"), list)
    if not shape_ok or document.get("format") != FORMAT:
        raise ValueError(f"{path}: not a prompt-embeddings manifest of format {FORMAT}")
    try:
        requests = [RolloutRequest.from_json(r) for r in document["requests"]]
    except RequestError as exc:
        raise ValueError(f"{path}: {exc}") from None
    return Path(document["cache"]), requests


def preload(engine: Any, manifest: str | Path, *, log: Log) -> PromptStore:
    """serve-engine's start-up: build the store of ``manifest`` on ``engine``'s family
    (its cache entries, or encodes of missing ones), free the encoders, and put the store
    in front of the engine's conditioning cache."""
    folder, requests = read_manifest(manifest)
    store = PromptStore.build(engine.family, requests, folder, log=log)
    store.free_encoders()
    engine.conditioning_cache.store = store
    stats = store.stats
    log(
        f"{FLAG}: {len(store.entries)} prompt encodings ({stats.loaded} from {folder}, {stats.encoded} encoded); "
        f"text encoders freed ({store.freed_bytes / 2**20:.1f} MiB)"
    )
    return store
