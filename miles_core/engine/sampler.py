"""The sampling loop behind ``/rollout/generate``, generic over model families.

One conditioning encode per request; all ``num_outputs_per_prompt`` outputs denoised as
one batch (or one at a time for families whose forward has no batch dimension). Output
*i* owns a generator seeded ``seed + i`` that draws its initial noise and then the
noise of each of its SDE steps, so an output does not depend on which other outputs
share its batch. The generator lives on the CPU (the request's ``generator_device``
``cpu``, the default: the same noise on any machine) or on the model's device
(``cuda``: the reference's default, reproducible on the same GPU type only). Steps run
through the same :mod:`miles_core.sde` code the trainer uses to recompute
log-probabilities.
"""

from __future__ import annotations

import resource
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from miles_core.conditioning_image import check_request_image
from miles_core.errors import GenerationCancelled, RequestError
from miles_core.family import Conditioning, GenerationParams, Latents, ModelFamily, Schedule
from miles_core.request import RolloutOutput, RolloutRequest
from miles_core.sde import OdeBackend, SdeBackend, StreamStep, score_streams, step_streams

if TYPE_CHECKING:
    from miles_core.engine.prompt_store import PromptStore


class ConditioningCache:
    """Recently encoded prompts, so the microgroups of one prompt group (and repeated
    evaluation prompts) encode their prompt once. Families encode with frozen text
    encoders, never with a trainable component; as a safety net the engine still clears
    the cache whenever it receives weights. A cached encoding is the tensor a new encode
    would give, so results do not depend on the cache (a test checks it).

    ``store``: a :class:`~miles_core.engine.prompt_store.PromptStore` (a run's
    ``--precompute-prompt-embeddings``) consulted first; it survives :meth:`clear`, since
    it holds encodings of frozen text encoders only, and a prompt missing from it is an
    error (its encoders are freed).

    ``on_host``: the entries are kept in host memory and copied to the family's device
    when used (the trainer's SFT cache: thousands of prompts would otherwise sit on the
    GPU, 11 GB for SD3's, up to 51 GB for LTX-2's); ``max_bytes`` bounds what the entries
    hold, the least recently used going first (an entry larger than the bound is not kept)."""

    def __init__(
        self, max_entries: int = 64, store: PromptStore | None = None, *, on_host: bool = False, max_bytes: int | None = None
    ) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.on_host = on_host
        self.store = store
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[tuple, Conditioning] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def encode(self, family: ModelFamily, prompt: str, negative_prompt: str | None, params: GenerationParams) -> Conditioning:
        if self.store is not None:
            return self.store.get(prompt, negative_prompt, params)
        key = (prompt, negative_prompt, repr(params))
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                self.hits += 1
                cached = self._entries[key]
                return _moved(cached, family.device) if self.on_host else cached
        cond = family.encode(prompt, negative_prompt, params)
        kept = _moved(cond, torch.device("cpu")) if self.on_host else cond
        size = _conditioning_bytes(kept)
        with self._lock:
            self.misses += 1
            if key not in self._entries and (self.max_bytes is None or size <= self.max_bytes):
                self._entries[key] = kept
                self._bytes += size
            while len(self._entries) > self.max_entries or (self.max_bytes is not None and self._bytes > self.max_bytes):
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= _conditioning_bytes(evicted)
        return cond

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the encodings it holds (not the store's)."""
        with self._lock:
            return self._bytes


def _conditioning_bytes(cond: Conditioning) -> int:
    return sum(t.numel() * t.element_size() for part in (cond.positive, cond.negative or {}) for t in part.values())


def _moved(cond: Conditioning, device: torch.device) -> Conditioning:
    """``cond`` with every tensor on ``device`` (the same tensors when already there)."""

    def move(part: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
        return None if part is None else {name: tensor.to(device) for name, tensor in part.items()}

    return Conditioning(move(cond.positive), move(cond.negative))  # type: ignore[arg-type]


def sample(
    family: ModelFamily,
    request: RolloutRequest,
    backends: Mapping[str, type[SdeBackend]],
    cache: ConditioningCache | None = None,
    cancel: threading.Event | None = None,
    decode_batch_size: int = 1,
) -> list[RolloutOutput]:
    """Run one request; return one record per output. Once ``cancel`` is set the
    denoising loop stops before its next step with :class:`GenerationCancelled`.
    ``decode_batch_size``: outputs decoded at once (:func:`decode_outputs`)."""
    if decode_batch_size < 1:
        raise ValueError(f"decode_batch_size must be at least 1, got {decode_batch_size}")
    start = time.perf_counter()
    if request.rollout_sde_type not in backends:
        raise RequestError("rollout_sde_type", f"{request.rollout_sde_type!r} is not an installed backend ({', '.join(sorted(backends))})")
    check_request_image(family, request)
    params = family.resolve_params(request)
    schedule = family.schedule(params)
    steps = int(schedule.timesteps.shape[0])
    if steps != request.num_inference_steps:
        raise RuntimeError(f"{type(family).__name__}.schedule gave {steps} steps, asked for {request.num_inference_steps}")
    stochastic = backends[request.rollout_sde_type](
        noise_level=request.rollout_noise_level, log_prob_no_const=request.rollout_log_prob_no_const
    )
    deterministic = OdeBackend(noise_level=0.0)
    with torch.no_grad():
        if cache is None:
            cond = family.encode(request.prompt, request.negative_prompt, params)
        else:
            cond = cache.encode(family, request.prompt, request.negative_prompt, params)
        count = request.num_outputs_per_prompt
        generators = output_generators(request.seed, count, generator_device(request, family))
        batches = [list(range(count))] if family.batched_outputs else [[i] for i in range(count)]
        records: list[RolloutOutput] = []
        for rows in batches:
            records += _denoise(
                family,
                request,
                params,
                schedule,
                cond.expand(len(rows)),
                [generators[i] for i in rows],
                [request.seed + i for i in rows],
                stochastic,
                deterministic,
                cancel,
                decode_batch_size,
            )
    elapsed = time.perf_counter() - start
    peak = _peak_memory_mb(family.device)
    for record in records:
        record.inference_time_s = elapsed
        record.peak_memory_mb = peak
    return records


def _denoise(
    family: ModelFamily,
    request: RolloutRequest,
    params: GenerationParams,
    schedule: Schedule,
    cond: Conditioning,
    generators: Sequence[torch.Generator],
    seeds: Sequence[int],
    stochastic: SdeBackend,
    deterministic: SdeBackend,
    cancel: threading.Event | None = None,
    decode_batch_size: int = 1,
) -> list[RolloutOutput]:
    batch = len(generators)
    sigmas = schedule.sigmas.to(torch.float32).cpu()
    steps = int(schedule.timesteps.shape[0])
    sigma_max = float(sigmas[1]) if steps > 1 else float(sigmas[0])
    sde_steps = set(request.sde_steps())
    want_trajectory = request.rollout and request.rollout_return_dit_trajectory
    return_steps = set(request.return_steps()) if want_trajectory else set()
    debug = request.rollout and request.rollout_debug_mode

    # Contiguous whatever layout the family hands back (a packing can be a transposed
    # view): every later latent inherits it, and the per-sample log-prob reductions must sum
    # in the order the trainer's recomputation (over stacked, contiguous copies) does.
    latents = {name: x.contiguous() for name, x in family.initial_latents(params, generators).items()}
    trajectory: dict[int, Latents] = {0: latents} if 0 in return_steps else {}
    log_probs = torch.zeros(batch, steps, dtype=torch.float32)
    records: dict[str, list[torch.Tensor]] = {"noise": [], "mean": [], "std": [], "velocity": []}
    fallbacks = 0
    for k in range(steps):
        if cancel is not None and cancel.is_set():
            raise GenerationCancelled(request.request_id, k, steps)
        timestep = schedule.timesteps[k].expand(batch).to(family.device)
        velocity = family.predict(latents, timestep, cond, params)
        is_sde = k in sde_steps
        noise = _draw_noise(latents, generators) if is_sde else None
        result: StreamStep = step_streams(
            stochastic if is_sde else deterministic,
            latents,
            velocity,
            float(sigmas[k]),
            float(sigmas[k + 1]),
            sigma_max=sigma_max,
            noise=noise,
            step_index=k,
        )
        next_latents = {name: tensor.to(family.dtype) for name, tensor in result.prev_sample.items()}
        if is_sde and family.dtype != torch.float32:
            # The trajectory keeps x' in the model dtype: score that rounded value, which
            # is what the trainer will see, not the fp32 draw.
            result.log_prob = score_streams(
                stochastic,
                next_latents,
                latents,
                velocity,
                float(sigmas[k]),
                float(sigmas[k + 1]),
                sigma_max=sigma_max,
                step_index=k,
            ).log_prob
        fallbacks += result.fallback_count
        if is_sde:
            log_probs[:, k] = result.log_prob.float().cpu()
        if debug:
            primary = family.latent_streams[0]
            records["noise"].append(noise[primary] if noise else torch.zeros_like(latents[primary], dtype=torch.float32))
            records["mean"].append(result.mean[primary])
            records["std"].append(result.std[primary].reshape(batch))
            records["velocity"].append(velocity[primary].float())
        latents = next_latents
        if k + 1 in return_steps:
            trajectory[k + 1] = latents
    pixels, extra = decode_outputs(family, family.final_latents(latents, cond, params), params, decode_batch_size)
    outputs = []
    for i in range(batch):
        output = RolloutOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            seed=seeds[i],
            generated_output=pixels[i],
            extra_outputs=extra[i],
            log_prob_fallbacks=fallbacks,
        )
        if request.rollout:
            output.rollout_log_probs = log_probs[i].clone()
        if want_trajectory:
            indices = sorted(trajectory)
            output.dit_trajectory = {
                name: torch.stack([trajectory[j][name][i].float().cpu() for j in indices]) for name in family.latent_streams
            }
            output.dit_trajectory.update(
                timesteps=schedule.timesteps.float().cpu(),
                sigmas=sigmas.clone(),
                step_indices=torch.tensor(indices, dtype=torch.int64),
                sde_step_indices=torch.tensor(sorted(sde_steps), dtype=torch.int64),
            )
        if request.rollout and request.rollout_return_denoising_env:
            output.denoising_env = _denoising_env(cond, params, i)
        if debug:
            output.rollout_debug_tensors = {
                "rollout_variance_noises": torch.stack([t[i].float().cpu() for t in records["noise"]]),
                "rollout_prev_sample_means": torch.stack([t[i].float().cpu() for t in records["mean"]]),
                "rollout_noise_std_devs": torch.stack([t[i].float().cpu() for t in records["std"]]),
                "rollout_model_outputs": torch.stack([t[i].float().cpu() for t in records["velocity"]]),
                "rollout_log_prob_fallbacks": torch.tensor(fallbacks, dtype=torch.int64),
            }
        outputs.append(output)
    return outputs


def decode_outputs(
    family: ModelFamily, final: Latents, params: GenerationParams, batch_size: int
) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """Each output's pixels and extra outputs, in fp32 on the host, decoded
    ``batch_size`` outputs at a time (``--vae-decode-batch-size``).

    A chunk's pixels leave the device before the next chunk decodes, so the device holds
    one chunk's decoder activations and pixels, not a microgroup's: 8 videos of 121
    frames at 704x1280 are 10.5 GB of fp32 pixels alone. The VAE decodes each output on
    its own (no layer mixes the batch), so the chunking changes the result only by the
    kernels' rounding at another batch size (bench/decode_chunks.py measures it)."""
    batch = next(iter(final.values())).shape[0]
    pixels: list[torch.Tensor] = []
    extras: list[dict[str, torch.Tensor]] = []
    for start in range(0, batch, batch_size):
        part = {name: value[start : start + batch_size] for name, value in final.items()}
        decoded = family.decode(part, params).float().cpu()
        extra = {name: value.float().cpu() for name, value in family.extra_outputs(part, params).items()}
        del part
        pixels += list(decoded)
        extras += [{name: value[i] for name, value in extra.items()} for i in range(decoded.shape[0])]
    return pixels, extras


def generator_device(request: RolloutRequest, family: ModelFamily) -> torch.device:
    """Where a request's generators live: the CPU for ``generator_device`` ``cpu``, the
    device the model runs on (``family.device``) otherwise."""
    return torch.device("cpu") if request.generator_device == "cpu" else torch.device(family.device)


def output_generators(seed: int, count: int, device: torch.device | str) -> list[torch.Generator]:
    """Output *i*'s generator, on ``device``, seeded ``seed + i`` (every device alike)."""
    return [torch.Generator(device=device).manual_seed(seed + i) for i in range(count)]


def _draw_noise(latents: Latents, generators: Sequence[torch.Generator]) -> Latents:
    # Per output and per stream, from that output's own generator, on its device in fp32:
    # the draw does not depend on the batch an output shares (nor, with CPU generators,
    # on the device the model runs on).
    noise: Latents = {}
    for name, tensor in latents.items():
        rows = [torch.randn(tensor.shape[1:], generator=g, device=g.device, dtype=torch.float32) for g in generators]
        noise[name] = torch.stack(rows).to(tensor.device)
    return noise


def _denoising_env(cond: Conditioning, params: GenerationParams, i: int) -> dict:
    def row(tensors: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
        return None if tensors is None else {k: v[i].float().cpu() for k, v in tensors.items()}

    image_kwargs = {"height": params.height, "width": params.width}
    if params.num_frames is not None:
        image_kwargs["num_frames"] = params.num_frames
    if params.fps is not None:
        image_kwargs["fps"] = params.fps
    guidance = {"guidance_scale": params.guidance_scale, **dict(params.extra)}
    if params.true_cfg_scale is not None:
        guidance["true_cfg_scale"] = params.true_cfg_scale
    return {
        "image_kwargs": image_kwargs,
        "pos_cond_kwargs": row(cond.positive),
        "neg_cond_kwargs": row(cond.negative),
        "guidance": guidance,
    }


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # ru_maxrss is in kilobytes on Linux and bytes on macOS.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**20 if sys.platform == "darwin" else 2**10)
