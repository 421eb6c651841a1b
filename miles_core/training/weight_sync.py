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

Training ranks on Ray send the weights themselves (:func:`send_from_rank`): every rank
gathers them one tensor at a time and rank 0 posts the buckets, so no process holds the
whole trainable state; the driver compares the checksums (:func:`check_checksums`).

The path the buckets take is ``--weight-sync-path``'s
(:func:`~miles_core.config.sync_path.choose_sync_path`): posted over HTTP (``http``; the
``sglang`` engine writes them to disk instead, ``disk``), broadcast in a torch.distributed
group of the trainer (rank 0) and the engine servers (``distributed``: one group per set of
servers, kept from sync to sync and closed by :func:`close_weight_groups`), or handed over
as CUDA-IPC handles (``cuda-ipc``, :mod:`miles_core.training.ipc_sync`; a run's syncs are
dispatched by :mod:`miles_core.training.sync_dispatch`). Every path ends with the same
checksum comparison.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
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


def _merged(weight: torch.Tensor, layer: Any, prefix: str, delta: Callable[[str], torch.Tensor] | None = None) -> torch.Tensor:
    """``W + Σ delta`` over the active adapters, as PEFT's ``merge`` computes it
    (``delta``: the adapter's delta weight, default PEFT's ``get_delta_weight``)."""
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
        merged += (delta or layer.get_delta_weight)(adapter)
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
    for name, _, parameter, prefix in _engine_entries(module, layers):
        yield name, (_merged(parameter, layers[prefix], prefix) if prefix is not None else parameter.detach())


def _engine_entries(module: torch.nn.Module, layers: Mapping[str, Any]) -> list[tuple[str, str, torch.Tensor, str | None]]:
    """``(engine name, parameter name, parameter, LoRA layer prefix or None)`` of what
    :func:`engine_weights` yields, in sorted engine-name order; the prefix is set for a
    base weight that gets its adapters' deltas merged in."""
    entries: list[tuple[str, str, torch.Tensor, str | None]] = []
    for name, parameter in module.named_parameters():
        prefix = _owner(name, layers)
        if prefix is None:
            entries.append((name, name, parameter, None))
            continue
        rest = name[len(prefix) + 1 :]
        if not rest.startswith("base_layer."):
            continue  # lora_A / lora_B / ... of the adapter
        rest = rest[len("base_layer.") :]
        entries.append((f"{prefix}.{rest}", name, parameter, prefix if rest == "weight" else None))
    names = [n for n, _, _, _ in entries]
    if len(set(names)) != len(names):
        raise ValueError("engine_weights: two parameters map to one name (nested adapters?)")
    return sorted(entries, key=lambda e: e[0])


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
        self.seconds = 0.0  # spent hashing (reported apart from the transfer)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        previous = None
        for name, tensor in self.items:
            if previous is not None and name <= previous:
                raise ValueError(f"weights must come in sorted name order ({name!r} after {previous!r})")
            previous = name
            tensor = tensor.detach().cpu().contiguous()
            began = time.perf_counter()
            self.digest.update(name.encode())
            self.digest.update(tensor.reshape(-1).view(torch.uint8).numpy().data)
            self.seconds += time.perf_counter() - began
            self.bytes += tensor.numel() * tensor.element_size()
            self.count += 1
            yield name, tensor


@dataclass
class SyncResult:
    seconds: float = 0.0
    bytes: int = 0  # tensor bytes sent to each engine server
    checksums: dict[str, str] = field(default_factory=dict)  # module -> the checksum every server reported
    checksum_seconds: float = 0.0
    """Of ``seconds``: hashing what was sent, and asking the servers for their checksums."""
    path: str = "http"
    """The ``--weight-sync-path`` it took."""

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


def sync_path(config: Any) -> str:
    """The path this run's syncs take: ``--weight-sync-path``, ``auto`` resolved by
    :func:`~miles_core.config.sync_path.run_sync_path` (a configuration without the flag,
    such as a test's namespace: ``http``)."""
    chosen = getattr(config, "weight_sync_path", None)
    if chosen is None:
        return "http"
    if chosen == "auto":
        from miles_core.config.sync_path import run_sync_path

        chosen = run_sync_path(config, cuda=torch.cuda.is_available())
    return "http" if chosen == "none" else chosen


async def sync_to_engine(engine: Any, modules: Mapping[str, torch.nn.Module] | Sequence[ModuleWeights], config: Any) -> SyncResult:
    """Send the trained modules' weights (or a :func:`snapshot_weights` of them) to every
    server of ``engine`` (an :class:`~miles_core.engine.http.HttpEngine`, or the ``sglang``
    engine) along :func:`sync_path`: ``http``, ``disk`` or ``distributed`` (a run's syncs go
    through :func:`~miles_core.training.sync_dispatch.sync_weights`, which sends ``cuda-ipc``
    itself; under ``cuda-ipc`` this sends a host snapshot, a re-sync, as ``http``), then check
    every server's checksums."""
    path = sync_path(config)
    if path == "cuda-ipc":
        path = "http"  # what reaches here under cuda-ipc (a host snapshot: a re-sync) goes as bytes
    began = time.perf_counter()
    lora_only = bool(config.lora_ipc_weight_sync)
    weights = (
        [_module_weights(name, module, lora_only) for name, module in modules.items()] if isinstance(modules, Mapping) else list(modules)
    )
    result = SyncResult(path=path)
    sender = await group_sender(engine.weight_urls(), config, api_key=getattr(engine, "api_key", None)) if path == "distributed" else None
    for module_weights in weights:
        name = module_weights.name
        sent = _Hashing(module_weights.tensors)
        if lora_only and (module_weights.lora_config is None or module_weights.checksum is None):
            raise ValueError(f"{name}: a LoRA-only sync needs the weights of a LoRA-only snapshot")
        send = sender.send if sender is not None else engine.update_weights_from_tensors
        if lora_only:
            await send(name, sent, buffer_size=config.update_weight_buffer_size, lora_only=True, lora_config=module_weights.lora_config)
            result.checksums[name] = module_weights.checksum
        else:
            await send(name, sent, buffer_size=config.update_weight_buffer_size)
            result.checksums[name] = sent.digest.hexdigest()
        result.bytes += sent.bytes
        result.checksum_seconds += sent.seconds
    checking = time.perf_counter()
    await check_checksums(engine, result.checksums, lora_only=lora_only)
    _GROUP_STATE["synced"] = True
    result.checksum_seconds += time.perf_counter() - checking
    result.seconds = time.perf_counter() - began
    return result


# -- the distributed path: one weight-update group per set of engine servers ------------------

_GROUPS: dict[tuple[str, ...], Any] = {}
"""The open :class:`~miles_core.engine.group_sender.GroupSender` of each set of server URLs."""
_GROUP_STATE = {"synced": False}
"""Whether a sync went through since the groups were last closed: a group that cannot be
made before that fails the run at start-up (exit status 2), after it mid-run (1)."""

JOIN_TIMEOUT_ENV = "MILES_WEIGHT_SYNC_JOIN_TIMEOUT"
ADDRESS_ENV = "MILES_WEIGHT_SYNC_ADDRESS"


def _group_backend(config: Any) -> str:
    """nccl when this process has CUDA and the run's backend is not gloo; else gloo."""
    backend = getattr(config, "distributed_backend", None)
    return "nccl" if torch.cuda.is_available() and backend != "gloo" else "gloo"


async def group_sender(urls: Sequence[str], config: Any, *, api_key: str | None = None) -> Any:
    """The open weight-update group with the servers ``urls`` (this process is rank 0),
    made on first use (its requests carry ``api_key``, the servers' key); a group sharing a
    server with them (the set changed: a server was restarted or left) is closed first.
    ``MILES_WEIGHT_SYNC_ADDRESS`` overrides the address the servers reach this process at,
    ``MILES_WEIGHT_SYNC_JOIN_TIMEOUT`` (seconds, default 60) how long they may take to join."""
    import os

    from miles_core.engine.group_sender import GroupSender
    from miles_core.engine.weight_group import DEFAULT_JOIN_TIMEOUT_S

    key = tuple(dict.fromkeys(url.rstrip("/") for url in urls))
    sender = _GROUPS.get(key)
    if sender is not None and sender.group is not None:
        return sender
    for other in [k for k in _GROUPS if set(k) & set(key)]:
        await _GROUPS.pop(other).close()
    minutes = getattr(config, "distributed_timeout_minutes", None) or 10
    sender = GroupSender(
        key,
        backend=_group_backend(config),
        master_address=os.environ.get(ADDRESS_ENV) or None,
        join_timeout=float(os.environ.get(JOIN_TIMEOUT_ENV) or DEFAULT_JOIN_TIMEOUT_S),
        timeout=60.0 * minutes,
        api_key=api_key,
    )
    await sender.open(startup=not _GROUP_STATE["synced"])
    _GROUPS[key] = sender
    return sender


async def close_weight_groups() -> None:
    """Close every weight-update group this process opened (the servers asked to leave)."""
    while _GROUPS:
        _, sender = _GROUPS.popitem()
        await sender.close()
    _GROUP_STATE["synced"] = False


async def check_checksums(engine: Any, expected: Mapping[str, str], *, lora_only: bool) -> None:
    """Every server of ``engine`` must report ``expected[module]`` for each module, or
    :class:`WeightSyncError` names the URL and the module."""
    reported = await engine.weights_checksums(list(expected))
    for url, answer in reported.items():
        for name, want in expected.items():
            got = answer.get(name)
            if got != want:
                mode = "LoRA-only" if lora_only else "full"
                raise WeightSyncError(
                    f"{url}: module {name!r} reports checksum {got} after a {mode} weight sync; "
                    f"the trainer sent weights with checksum {want}"
                )


def sync_lora_only(config: Any) -> bool:
    """Whether a sync sends only the LoRA tensors: ``--lora-ipc-weight-sync``, or a LoRA
    run's embedded engine under ``--use-ray`` (on an actor of its own), which then runs
    the trainer's adapted modules (``W x + B A x``) as the in-process one does rather
    than merged weights, so it samples what the one-process run samples."""
    hosted = bool(config.get("use_ray")) and config.rollout_engine == "embedded"
    return bool(config.lora_ipc_weight_sync) or (bool(config.use_lora) and hosted)


# -- from the training ranks ------------------------------------------------------------------
# Under --use-ray no process but the ranks holds the trainable weights: the ranks gather
# what a sync sends one tensor at a time and rank 0 posts each bucket to the engines.


def _gathered(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``tensor`` whole on the CPU in ``dtype``; a DTensor's shards are all-gathered
    (collective: every rank gathers the same tensor at the same point)."""
    from miles_core.training.fsdp import is_sharded

    if is_sharded(tensor):
        tensor = tensor.full_tensor()
    return tensor.detach().to(device="cpu", dtype=dtype)


def _delta_from_shards(layer: Any, prefix: str, dtypes: Mapping[str, torch.dtype]) -> Callable[[str], torch.Tensor]:
    """PEFT's ``get_delta_weight`` of a ``Linear`` LoRA layer, on its gathered ``lora_A``
    and ``lora_B`` (collective): ``B @ A`` (transposed for ``fan_in_fan_out``) times the
    adapter's scaling, in float32 for half-precision factors as PEFT computes it on the CPU."""

    def delta(adapter: str) -> torch.Tensor:
        down, up = layer.lora_A[adapter], layer.lora_B[adapter]
        if not (isinstance(down, torch.nn.Linear) and isinstance(up, torch.nn.Linear)):
            raise ValueError(f"{prefix}: only Linear LoRA layers are merged from sharded weights, not {type(down).__name__}")
        a = _gathered(down.weight, dtypes.get(f"{prefix}.lora_A.{adapter}.weight", down.weight.dtype))
        b = _gathered(up.weight, dtypes.get(f"{prefix}.lora_B.{adapter}.weight", up.weight.dtype))
        dtype = b.dtype
        if dtype in (torch.float16, torch.bfloat16):
            a, b = a.float(), b.float()
        product = b @ a
        if getattr(layer, "fan_in_fan_out", False):
            product = product.T
        return (product * layer.scaling[adapter]).to(dtype)

    return delta


def rank_engine_tensors(
    module: torch.nn.Module, dtypes: Mapping[str, torch.dtype], *, lora_only: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """What a sync sends for ``module`` (a training rank's component, sharded or not),
    whole and in the dtypes an engine holds (``dtypes``: parameter name -> dtype, the
    trainer's ``engine_dtypes`` of the component), one tensor at a time in sorted name
    order: the ``lora_A``/``lora_B`` tensors (``lora_only``) or :func:`engine_weights`.
    Under FSDP2 every rank must consume it to the end (each tensor is a collective)."""
    from miles_core.training.fsdp import is_sharded

    if lora_only:
        for name, parameter in sorted(lora_tensors(module), key=lambda item: item[0]):
            yield name, _gathered(parameter, dtypes.get(name, parameter.dtype))
        return
    layers = _lora_layers(module)
    for name, parameter_name, parameter, prefix in _engine_entries(module, layers):
        dtype = dtypes.get(parameter_name, parameter.dtype)
        if prefix is None:
            yield name, _gathered(parameter, dtype)
        elif is_sharded(parameter):
            delta = _delta_from_shards(layers[prefix], prefix, dtypes)
            yield name, _merged(_gathered(parameter, dtype), layers[prefix], prefix, delta).to(dtype)
        else:
            yield name, _merged(parameter, layers[prefix], prefix).to(dtype)


def rank_module_checksum(module: torch.nn.Module, dtypes: Mapping[str, torch.dtype]) -> str:
    """The checksum an engine holding ``module`` as it is (adapters included) reports,
    from a training rank: every parameter gathered in turn (collective under FSDP2)."""
    named = sorted(module.named_parameters(), key=lambda item: item[0])
    hashing = _Hashing((name, _gathered(parameter, dtypes.get(name, parameter.dtype))) for name, parameter in named)
    for _ in hashing:
        pass
    return hashing.digest.hexdigest()


def send_from_rank(
    modules: Mapping[str, torch.nn.Module],
    dtypes: Mapping[str, Mapping[str, torch.dtype]],
    urls: Sequence[str],
    config: Any,
    *,
    lora_only: bool,
    sends: bool,
    path: str | None = None,
    api_key: str | None = None,
) -> dict[str, Any]:
    """One weight sync from the training ranks (every rank calls it together): each
    module's tensors are gathered as :func:`rank_engine_tensors` yields them, and the
    sender (``sends``: rank 0) posts them to every server of ``urls`` in safetensors
    buckets of at most ``--update-weight-buffer-size`` bytes as each bucket fills; no rank
    holds more than one bucket of gathered weights (``--weight-sync-path distributed``: the
    sender broadcasts them in its weight-update group with the servers instead, see
    :func:`group_sender`). Returns what the sender sent: ``{"checksums": {module: sha256},
    "bytes": n, "error": None | [url, status, message], "failure": None | [message,
    exit_code]}`` (``failure``: the weight-update group could not be made or used);
    ``path``: ``http`` or ``distributed`` as the driver decided it for every rank
    (default: :func:`sync_path` of ``config`` in this process); ``api_key``: the servers'
    key, which every request carries (the driver's, given as an argument). A
    server that refuses or does not answer stops the sending; the gathers still go on to
    the end, so the ranks' collectives stay paired."""
    return asyncio.run(_send_from_rank(modules, dtypes, list(urls), config, lora_only, sends, path or sync_path(config), api_key))


async def _send_from_rank(
    modules: Mapping[str, torch.nn.Module],
    dtypes: Mapping[str, Mapping[str, torch.dtype]],
    urls: list[str],
    config: Any,
    lora_only: bool,
    sends: bool,
    path: str,
    api_key: str | None,
) -> dict[str, Any]:
    from miles_core.engine.http import HttpEngine
    from miles_core.errors import EngineRequestError, WeightGroupError

    client = HttpEngine(urls, api_key=api_key) if sends and urls else None
    answer: dict[str, Any] = {"checksums": {}, "bytes": 0, "error": None, "failure": None}
    send = client.update_weights_from_tensors if client is not None else None
    if client is not None and path == "distributed":
        try:
            send = (await group_sender(urls, config, api_key=api_key)).send
        except WeightGroupError as exc:
            answer["failure"] = [str(exc), exc.exit_code]
    try:
        for name, module in modules.items():
            tensors = rank_engine_tensors(module, dtypes[name], lora_only=lora_only)
            if send is not None and answer["error"] is None and answer["failure"] is None:
                sent = _Hashing(tensors)
                try:
                    await send(
                        name,
                        sent,
                        buffer_size=config.update_weight_buffer_size,
                        lora_only=lora_only,
                        lora_config=lora_config(module) if lora_only else None,
                    )
                    answer["bytes"] += sent.bytes
                    answer["checksums"][name] = sent.digest.hexdigest()
                except EngineRequestError as exc:
                    answer["error"] = [exc.url, exc.status, exc.message]
                except WeightGroupError as exc:
                    answer["failure"] = [str(exc), exc.exit_code]
            for _ in tensors:  # what is left (everything, on the other ranks): gathered and dropped
                pass
            if lora_only:  # the engine's module holds the base weights and the adapter
                answer["checksums"][name] = rank_module_checksum(module, dtypes[name])
    finally:
        if client is not None:
            await client.close()
    if client is not None and answer["error"] is None and answer["failure"] is None:
        _GROUP_STATE["synced"] = True  # a later group failure is mid-run
    return answer


__all__ = [
    "ModuleWeights",
    "SyncResult",
    "WeightSyncError",
    "check_checksums",
    "close_weight_groups",
    "engine_weights",
    "expected_checksum",
    "group_sender",
    "lora_config",
    "lora_tensors",
    "rank_engine_tensors",
    "rank_module_checksum",
    "send_from_rank",
    "snapshot_weights",
    "sync_lora_only",
    "sync_path",
    "sync_to_engine",
]
