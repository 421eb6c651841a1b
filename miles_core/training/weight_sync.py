"""Weight sync from the trainer to remote rollout engines (``--rollout-engine http``).

Two modes, as in the reference:

- full (the default): every weight of each trained module, with the LoRA delta merged in
  when the trainer trains a LoRA, under the plain module's parameter names. The engine
  needs no LoRA layers: it holds exactly the weights ``merge_and_unload`` would give.
- LoRA-only (``--lora-ipc-weight-sync``): just the ``lora_A``/``lora_B`` tensors. The
  engine must hold the same adapter; every request carries the adapter's ``lora_config``
  so that a server without one adds it (once) before loading the tensors.

Tensors travel as safetensors buckets of at most ``--update-weight-buffer-size`` bytes.
Afterwards every engine server's ``/get_weights_checksum`` must equal the trainer-side
checksum of the same weights (see :func:`expected_checksum`); a mismatch raises
:class:`WeightSyncError` naming the URL and the module.

:func:`snapshot_weights` copies what a sync would send, so that a sync that runs while
the modules may change (an engine restarted mid-run, re-synced in the background) sends
the weights of one moment.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from miles_core.errors import WeightSyncError
from miles_core.weights import named_tensors_checksum


def _lora_layers(module: torch.nn.Module) -> dict[str, Any]:
    """The module's PEFT tuner layers by prefix (empty for a plain module)."""
    try:
        from peft.tuners.lora import LoraLayer
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # no PEFT: no adapters
        return {}
    layers = {}
    for prefix, sub in module.named_modules():
        if isinstance(sub, BaseTunerLayer):
            if not isinstance(sub, LoraLayer):
                raise TypeError(f"{prefix}: {type(sub).__name__} adapters are not supported by weight sync (LoRA only)")
            layers[prefix] = sub
    return layers


def _owner(name: str, layers: Mapping[str, Any]) -> str | None:
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:i])
        if prefix in layers:
            return prefix
    return None


def _merged(weight: torch.Tensor, layer: Any, prefix: str) -> torch.Tensor:
    """``W + Σ delta`` over the active adapters, as PEFT's ``merge`` computes it."""
    merged = weight.detach().clone()
    if layer.disable_adapters:
        return merged
    if layer.merged:
        raise ValueError(f"{prefix}: the adapter is merged into the base weights; unmerge it before weight sync")
    for adapter in layer.active_adapters:
        if adapter not in layer.scaling:
            continue
        if getattr(layer, "lora_variant", {}).get(adapter) is not None or getattr(layer, "use_dora", {}).get(adapter):
            raise ValueError(f"{prefix}: LoRA variants (DoRA, ...) are not supported by weight sync")
        if getattr(layer, "lora_bias", {}).get(adapter):
            raise ValueError(f"{prefix}: lora_bias adapters are not supported by weight sync")
        merged += layer.get_delta_weight(adapter)
    return merged


@torch.no_grad()
def engine_weights(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights an engine without LoRA layers must hold, in sorted name order.

    For a PEFT-adapted module: every base weight under the plain module's name
    (``...to_q.base_layer.weight`` -> ``...to_q.weight``), with the active adapters'
    deltas merged (PEFT's ``get_delta_weight``, added as its ``merge`` adds it);
    ``lora_*`` tensors are left out. For a plain module: its parameters. Merged tensors
    are computed one at a time, as they are consumed."""
    layers = _lora_layers(module)
    entries: list[tuple[str, torch.Tensor, str | None]] = []
    for name, parameter in module.named_parameters():
        prefix = _owner(name, layers)
        if prefix is None:
            entries.append((name, parameter, None))
            continue
        rest = name[len(prefix) + 1 :]
        if not rest.startswith("base_layer."):
            continue  # lora_A / lora_B / ... of the adapter
        rest = rest[len("base_layer.") :]
        entries.append((f"{prefix}.{rest}", parameter, prefix if rest == "weight" else None))
    names = [n for n, _, _ in entries]
    if len(set(names)) != len(names):
        raise ValueError("engine_weights: two parameters map to one name (nested adapters?)")
    for name, parameter, prefix in sorted(entries, key=lambda e: e[0]):
        yield name, (_merged(parameter, layers[prefix], prefix) if prefix is not None else parameter.detach())


def lora_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The ``lora_A``/``lora_B`` parameters under the names an engine-side module adapted
    with the same ``LoraConfig`` has (``...to_q.lora_A.default.weight``)."""
    for name, parameter in module.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            yield name, parameter.detach()


def lora_config(module: torch.nn.Module) -> dict[str, Any]:
    """The module's adapter as the ``lora_config`` field of a tensor update:
    ``{r, lora_alpha, target_modules, init_lora_weights}``."""
    configs = getattr(module, "peft_config", None) or {}
    if len(configs) != 1:
        raise ValueError(f"LoRA-only weight sync needs exactly one adapter, the module has {len(configs)}")
    (config,) = configs.values()
    targets = config.target_modules
    return {
        "r": int(config.r),
        "lora_alpha": config.lora_alpha,
        "target_modules": sorted(targets) if not isinstance(targets, str) else targets,
        "init_lora_weights": config.init_lora_weights,
    }


def expected_checksum(module: torch.nn.Module, *, lora_only: bool) -> str:
    """What an engine's ``/get_weights_checksum`` must report after a sync: the checksum
    of :func:`engine_weights` (full sync: the engine module is plain), or of the adapted
    module itself (LoRA-only: the engine module carries the same adapter and base
    weights, so its parameter names and values are the trainer's)."""
    return named_tensors_checksum(module.named_parameters() if lora_only else engine_weights(module))


class _Hashing:
    """Passes sorted ``(name, tensor)`` pairs through, moved to the CPU, while computing
    :func:`~miles_core.weights.named_tensors_checksum` of them and counting bytes."""

    def __init__(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.items = items
        self.digest = hashlib.sha256()
        self.bytes = 0
        self.count = 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        previous = None
        for name, tensor in self.items:
            if previous is not None and name <= previous:
                raise ValueError(f"weights must come in sorted name order ({name!r} after {previous!r})")
            previous = name
            tensor = tensor.detach().cpu().contiguous()
            self.digest.update(name.encode())
            self.digest.update(tensor.reshape(-1).view(torch.uint8).numpy().data)
            self.bytes += tensor.numel() * tensor.element_size()
            self.count += 1
            yield name, tensor


@dataclass
class SyncResult:
    seconds: float = 0.0
    bytes: int = 0  # tensor bytes sent to each engine server
    checksums: dict[str, str] = field(default_factory=dict)  # module -> the checksum every server reported

    def metrics(self) -> dict[str, float]:
        return {"perf/weight_sync_time": self.seconds, "perf/weight_sync_bytes": self.bytes}


@dataclass
class ModuleWeights:
    """What a sync sends for one module."""

    name: str
    tensors: Iterable[tuple[str, torch.Tensor]]
    """In sorted name order: :func:`engine_weights`, or the ``lora_A``/``lora_B`` tensors."""
    lora_config: dict[str, Any] | None = None
    """LoRA-only: the adapter (see :func:`lora_config`); None for a full sync."""
    checksum: str | None = None
    """LoRA-only: what the engine must report (the adapted module's checksum); a full
    sync's is the checksum of the tensors sent, computed as they go."""


def _module_weights(name: str, module: torch.nn.Module, lora_only: bool) -> ModuleWeights:
    if lora_only:
        return ModuleWeights(
            name, sorted(lora_tensors(module), key=lambda item: item[0]), lora_config(module), expected_checksum(module, lora_only=True)
        )
    return ModuleWeights(name, engine_weights(module))


def snapshot_weights(modules: Mapping[str, torch.nn.Module], config: Any) -> list[ModuleWeights]:
    """What :func:`sync_to_engine` would send for ``modules`` now, copied to the CPU:
    syncing the copy later sends these weights even if the modules have changed since
    (trained, or an EMA swap undone). Costs one copy of the synced weights."""
    lora_only = bool(config.lora_ipc_weight_sync)
    weights = []
    for name, module in modules.items():
        module_weights = _module_weights(name, module, lora_only)
        module_weights.tensors = [(key, tensor.detach().to("cpu", copy=True)) for key, tensor in module_weights.tensors]
        weights.append(module_weights)
    return weights


async def sync_to_engine(engine: Any, modules: Mapping[str, torch.nn.Module] | Sequence[ModuleWeights], config: Any) -> SyncResult:
    """Send the trained modules' weights (or a :func:`snapshot_weights` of them) to every
    server of ``engine`` (an :class:`~miles_core.engine.http.HttpEngine`), then check every
    server's checksums."""
    began = time.perf_counter()
    lora_only = bool(config.lora_ipc_weight_sync)
    weights = (
        [_module_weights(name, module, lora_only) for name, module in modules.items()] if isinstance(modules, Mapping) else list(modules)
    )
    result = SyncResult()
    for module_weights in weights:
        name = module_weights.name
        sent = _Hashing(module_weights.tensors)
        if lora_only:
            if module_weights.lora_config is None or module_weights.checksum is None:
                raise ValueError(f"{name}: a LoRA-only sync needs the weights of a LoRA-only snapshot")
            await engine.update_weights_from_tensors(
                name,
                sent,
                buffer_size=config.update_weight_buffer_size,
                lora_only=True,
                lora_config=module_weights.lora_config,
            )
            result.checksums[name] = module_weights.checksum
        else:
            await engine.update_weights_from_tensors(name, sent, buffer_size=config.update_weight_buffer_size)
            result.checksums[name] = sent.digest.hexdigest()
        result.bytes += sent.bytes
    reported = await engine.weights_checksums([module_weights.name for module_weights in weights])
    for url, answer in reported.items():
        for name, want in result.checksums.items():
            got = answer.get(name)
            if got != want:
                mode = "LoRA-only" if lora_only else "full"
                raise WeightSyncError(
                    f"{url}: module {name!r} reports checksum {got} after a {mode} weight sync; "
                    f"the trainer sent weights with checksum {want}"
                )
    result.seconds = time.perf_counter() - began
    return result


__all__ = [
    "ModuleWeights",
    "SyncResult",
    "WeightSyncError",
    "engine_weights",
    "expected_checksum",
    "lora_config",
    "lora_tensors",
    "snapshot_weights",
    "sync_to_engine",
]
