"""The embedded engine: the family's diffusers pipeline in the trainer's process.

Generation runs in a worker thread so the event loop stays responsive (a caller can
score one microgroup while others generate); one request runs at a time, since the
model is shared. Weight updates from the trainer need no serialization. That thread is
the process's compute thread: a run trains on it too (:meth:`EmbeddedEngine.run_compute`),
so one OpenMP pool serves all the heavy work (:mod:`miles_core.config.thread_plan`).

``--offload-rollout``: :meth:`EmbeddedEngine.release_memory` releases the storages of the
pipeline's modules (:class:`~miles_core.memory.OffloadedStorages`: host copies, tensors
kept) except those in :attr:`EmbeddedEngine.keep_on_release` (the modules a trainer in
this process runs); until :meth:`EmbeddedEngine.resume_memory`, generation, weight updates
and checksums raise :class:`~miles_core.errors.EngineReleasedError`.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch

from miles_core.engine.base import RolloutEngine
from miles_core.engine.sampler import ConditioningCache, sample
from miles_core.engine.torch_threads import pin_current_thread
from miles_core.errors import (
    EngineReleasedError,
    GenerationCancelled,
    LoraAdapterError,
    LoraAdapterMismatch,
    RequestError,
    WeightUpdateError,
)
from miles_core.family import ModelFamily
from miles_core.memory import OffloadedStorages, module_tensors
from miles_core.request import RolloutOutput, RolloutRequest
from miles_core.sde import SdeBackend
from miles_core.weights import load_component_from_disk, load_named_tensors, module_checksum

log = logging.getLogger(__name__)
T = TypeVar("T")

_CANCEL: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar("generation_cancel", default=None)
"""The cancel flag of the :meth:`EmbeddedEngine.generate` call running in this context: a
context variable as well as an argument, so that it also reaches ``generate_sync`` through
wrappers that pass only the request."""


def installed_backends(extra: Mapping[str, type[SdeBackend]] | None = None) -> dict[str, type[SdeBackend]]:
    """The registered SDE backends by name (plus one-off classes, e.g. from
    ``--sde-step-backend-path``)."""
    from miles_core.plugin_manager import get_host

    backends = {reg.name: reg.load() for reg in get_host().registries.sde_backend}
    backends.update(extra or {})
    return backends


class EmbeddedEngine(RolloutEngine):
    releases_memory: ClassVar[bool] = True

    def __init__(self, family: ModelFamily, *, backends: Mapping[str, type[SdeBackend]] | None = None, decode_batch_size: int = 1) -> None:
        self.family = family
        self.decode_batch_size = decode_batch_size
        """Outputs decoded at once (``--vae-decode-batch-size``; :func:`~miles_core.engine.sampler.decode_outputs`)."""
        self.backends = dict(backends) if backends is not None else installed_backends()
        self._lock = threading.Lock()
        self.conditioning_cache = ConditioningCache()
        self._executor: ThreadPoolExecutor | None = None
        self.keep_on_release: frozenset[str] = frozenset()
        """Pipeline modules :meth:`release_memory` leaves resident: those a trainer in this
        process runs while the engine is released (set by the run loop)."""
        self._released: OffloadedStorages | None = None

    @classmethod
    def from_checkpoint(
        cls,
        checkpoint: str | Path,
        family: str,
        *,
        device: Any = "cpu",
        dtype: torch.dtype | None = None,
        backends: Mapping[str, type[SdeBackend]] | None = None,
    ) -> EmbeddedEngine:
        """Load ``checkpoint`` with the registered family ``family``."""
        from miles_core.plugin_manager import get_host

        family_cls = get_host().registries.model_family.get(family).load()
        return cls(family_cls.from_pretrained(checkpoint, device=device, dtype=dtype), backends=backends)

    @classmethod
    def from_config(cls, config: Any) -> EmbeddedEngine:
        """The checkpoint and family of the configuration, on the machine's device in
        ``--diffusion-forward-dtype`` (the noise generators' device is each request's
        ``generator_device``); a
        ``--sde-step-backend-path`` class is served under that path as its name."""
        from miles_core.model_loading import load_family
        from miles_core.refs import resolve_path_flag

        extra = {}
        if config.sde_step_backend_path:
            extra[config.sde_step_backend_path] = resolve_path_flag("--sde-step-backend-path", config.sde_step_backend_path, "sde_backend")
        return cls(load_family(config), backends=installed_backends(extra), decode_batch_size=config.vae_decode_batch_size)

    # -- generation ------------------------------------------------------------------

    def generate_sync(self, request: RolloutRequest, cancel: threading.Event | None = None) -> list[RolloutOutput]:
        """Run ``request``; once ``cancel`` (default: the flag of the :meth:`generate` call
        this runs for) is set, stop before the next denoising step with
        :class:`~miles_core.errors.GenerationCancelled`."""
        request = request.with_request_id()
        cancel = cancel if cancel is not None else _CANCEL.get()
        with self._lock:
            self.require_resident("generate")
            try:
                return sample(
                    self.family, request, self.backends, self.conditioning_cache, cancel=cancel, decode_batch_size=self.decode_batch_size
                )
            except GenerationCancelled as exc:
                log.info("%s", exc)
                raise

    async def generate(self, request: RolloutRequest) -> list[RolloutOutput]:
        cancel = threading.Event()
        context = contextvars.copy_context()
        context.run(_CANCEL.set, cancel)
        job = asyncio.get_running_loop().run_in_executor(self._worker(), context.run, self.generate_sync, request)
        try:
            return await job
        except asyncio.CancelledError:
            # The caller gave up (an HTTP client went away, a run stopped): a queued request
            # never starts, a running one stops at its next step instead of holding the
            # model for the requests behind it.
            cancel.set()
            raise

    def _worker(self) -> ThreadPoolExecutor:
        # One thread of the engine's own: requests run one at a time anyway (the lock), and
        # waiting ones must not fill the event loop's default pool, which the rewards use
        # to score returned microgroups while the rest generates (streaming scoring).
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embedded-engine")
        return self._executor

    def pin_compute_threads(self, threads: int) -> None:
        """Give the engine's worker thread (started now if it is not yet) ``threads`` torch
        threads. torch then starts new threads with that count too: the caller sets the
        count other threads get afterwards (the run's thread plan does)."""
        self._worker().submit(pin_current_thread, threads).result()

    def _exclusive(self, fn: Callable[..., T], *args: Any) -> T:
        with self._lock:
            return fn(*args)

    async def run_compute(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the engine's thread, between requests (the trainer's
        steps: the same thread, so the same OpenMP pool, as generation)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._worker(), contextvars.copy_context().run, self._exclusive, fn, *args)

    def run_compute_sync(self, fn: Callable[..., T], *args: Any) -> T:
        """:meth:`run_compute` for a caller outside an event loop (never the engine's own
        thread): blocks until ``fn(*args)`` has run there."""
        return self._worker().submit(self._exclusive, fn, *args).result()

    async def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None

    # -- memory ----------------------------------------------------------------------

    def pipeline_modules(self) -> dict[str, torch.nn.Module]:
        """Every module of the pipeline by component name (VAE, text encoders, the
        transformers), the memory :meth:`release_memory` may release."""
        return {name: value for name, value in self.family.pipeline.components.items() if isinstance(value, torch.nn.Module)}

    @property
    def memory_released(self) -> bool:
        return self._released is not None

    def require_resident(self, what: str) -> None:
        """Raise :class:`~miles_core.errors.EngineReleasedError` while the memory is released."""
        if self._released is not None:
            raise EngineReleasedError(
                f"engine: cannot {what} while its memory is released (release_memory_occupation); resume it first (resume_memory_occupation)"
            )

    def release_memory_sync(self) -> str:
        """Release every pipeline module not in :attr:`keep_on_release` (waiting for the
        request in progress); returns what was done."""
        with self._lock:
            if self._released is not None:
                return "already released"
            modules = self.pipeline_modules()
            going = [m for name, m in modules.items() if name not in self.keep_on_release]
            staying = [m for name, m in modules.items() if name in self.keep_on_release]
            self._released = OffloadedStorages.offload(module_tensors(going), keep=module_tensors(staying))
            return f"released {self._released.nbytes} bytes of {len(going)} module(s)"

    def resume_memory_sync(self) -> str:
        with self._lock:
            if self._released is None:
                return "already resident"
            nbytes = self._released.nbytes
            self._released.restore()
            self._released = None
            return f"restored {nbytes} bytes"

    async def release_memory(self) -> str:
        return await asyncio.to_thread(self.release_memory_sync)

    async def resume_memory(self) -> str:
        return await asyncio.to_thread(self.resume_memory_sync)

    # -- weights ---------------------------------------------------------------------

    def component(self, name: str) -> torch.nn.Module:
        components = self.family.components()
        if name not in components:
            raise WeightUpdateError(f"unknown module {name!r}; this engine has {', '.join(components)}")
        return components[name]

    def update_weights_from_disk(self, model_path: str | Path, module_names: Sequence[str] | None = None) -> dict[str, int]:
        """Load each trainable component's folder of a diffusers directory (``model_path/transformer``...)."""
        root = Path(model_path)
        if not root.is_dir():
            raise WeightUpdateError(f"model_path {model_path}: not a directory")
        names = list(module_names) if module_names else list(self.family.components())
        loaded = {}
        with self._lock:
            self.require_resident("update weights")
            self.conditioning_cache.clear()
            for name in names:
                folder = root / name
                if not folder.is_dir() and any(root.glob("*.safetensors")):
                    folder = root  # a flat folder of one module's weights, as sglang-diffusion accepts
                loaded[name] = load_component_from_disk(self.component(name), folder, module_name=name)
        return loaded

    def update_weights_from_tensors(
        self,
        module_name: str,
        tensors: Mapping[str, torch.Tensor],
        *,
        lora_only: bool = False,
        lora_config: Mapping[str, Any] | None = None,
    ) -> int:
        """Copy named tensors (full weights or LoRA ``lora_A``/``lora_B``) into a module.
        With ``lora_config`` a module without an adapter first gets that one (see
        :meth:`ensure_lora_adapter`); a LoRA-only update needs the module to have one."""
        with self._lock:
            self.require_resident("update weights")
            self.conditioning_cache.clear()
            module = self.component(module_name)
            if lora_config is not None:
                self._ensure_lora_adapter(module_name, module, lora_config)
            elif lora_only and not getattr(module, "peft_config", None):
                raise LoraAdapterError(f"{module_name} has no LoRA adapter; a lora_only update to it must carry lora_config")
            return load_named_tensors(module, tensors, module_name=module_name)

    def ensure_lora_adapter(self, module_name: str, lora_config: Mapping[str, Any]) -> bool:
        """Give the module the LoRA adapter ``lora_config`` (``{r, lora_alpha,
        target_modules, init_lora_weights}``) through diffusers' ``add_adapter``, unless it
        has one; returns whether one was added. An existing adapter with another ``r``,
        ``lora_alpha`` or ``target_modules`` raises :class:`LoraAdapterMismatch`."""
        with self._lock:
            return self._ensure_lora_adapter(module_name, self.component(module_name), lora_config)

    @staticmethod
    def _ensure_lora_adapter(module_name: str, module: torch.nn.Module, lora_config: Mapping[str, Any]) -> bool:
        def shape(r: Any, alpha: Any, targets: Any) -> dict[str, Any]:
            return {"r": r, "lora_alpha": alpha, "target_modules": targets if isinstance(targets, str) else sorted(targets)}

        wanted = shape(lora_config["r"], lora_config["lora_alpha"], lora_config["target_modules"])
        existing = getattr(module, "peft_config", None) or {}
        if existing:
            held = [shape(c.r, c.lora_alpha, c.target_modules) for c in existing.values()]
            if held != [wanted]:
                raise LoraAdapterMismatch(f"{module_name} already has LoRA adapter(s) {held}; this update's lora_config is {wanted}")
            return False
        if not hasattr(module, "add_adapter"):
            raise LoraAdapterError(f"{module_name} ({type(module).__name__}) cannot take a LoRA adapter (no add_adapter)")
        from peft import LoraConfig

        try:
            module.add_adapter(
                LoraConfig(
                    r=lora_config["r"],
                    lora_alpha=lora_config["lora_alpha"],
                    target_modules=lora_config["target_modules"],
                    init_lora_weights=lora_config.get("init_lora_weights", True),
                )
            )
        except (ValueError, TypeError) as exc:
            # diffusers marks the module as adapted before PEFT injects anything: undo that.
            module.__dict__.pop("peft_config", None)
            module._hf_peft_config_loaded = False
            raise LoraAdapterError(f"{module_name}: cannot add the LoRA adapter: {exc}") from None
        # The trainer's flags (base frozen, adapter trainable): torch picks some kernels by
        # them even without autograd, so the engine then samples what the trainer computes.
        for name, parameter in module.named_parameters():
            parameter.requires_grad_("lora_" in name)
        return True

    def weights_checksum_sync(self, module_names: Iterable[str]) -> dict[str, str]:
        with self._lock:
            self.require_resident("compute weight checksums")
            return {name: module_checksum(self.component(name)) for name in module_names}

    async def weights_checksum(self, module_names: Sequence[str]) -> dict[str, str]:
        return await asyncio.to_thread(self.weights_checksum_sync, list(module_names))


__all__ = ["EmbeddedEngine", "LoraAdapterError", "LoraAdapterMismatch", "RequestError", "installed_backends"]
