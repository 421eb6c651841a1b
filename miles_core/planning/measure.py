"""What a run's components and one training step hold, counted on the meta device.

:func:`measure_run` builds the run's pipeline from its checkpoint's configuration files
(:mod:`miles_core.planning.meta_pipeline`), wraps it in the run's family and builds the
run's own :class:`~miles_core.training.trainer.Trainer` on it (LoRA adapters, master
weights, AdamW, EMA, gradient checkpointing exactly as a run sets them up), then runs on
meta tensors, under :mod:`miles_core.planning.tensor_bytes`' counters:

- one training micro-batch of each trained denoiser (the family's ``predict`` on the
  family's :meth:`~miles_core.family.ModelFamily.plan_conditioning`, the SDE log-prob,
  backward into the master weights) and the optimizer step, with gradient checkpointing
  on and off;
- one sampling forward (no gradient) and one VAE decode call, each at one output and at
  the configured microgroup (decode: ``--vae-decode-batch-size``), affine in between
  (:class:`Affine`), and the decode again with the VAE's tiling where it has one.

Nothing here reads a weight; :mod:`miles_core.planning.plan` turns the counts into a plan.
"""

from __future__ import annotations

import contextlib
import functools
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from miles_core.errors import CheckpointError
from miles_core.planning.tensor_bytes import LiveBytes, SavedForBackward, fused_attention, storage_bytes

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class Component:
    """One module of the pipeline as loaded (before any adapter is added)."""

    name: str
    class_name: str
    parameters: int
    nbytes: int
    dtype: str
    role: str
    """``trained`` (a denoiser this run trains), ``denoiser`` (a frozen one: a Wan expert
    left out), ``encoder`` (text or image encoders) or ``vae`` (every autoencoder, audio
    ones and vocoders included)."""


@dataclass(frozen=True)
class StepCount:
    """One training micro-batch of one denoiser, counted."""

    saved: int
    """Bytes autograd saved for the backward (parameters left out)."""
    retained: int
    """Bytes alive at the end of the forward: what the backward needs (with gradient
    checkpointing: the checkpoints' inputs and what lies outside the checkpointed blocks)."""
    peak: int
    """The highest bytes alive from the forward's start through the backward and the
    optimizer step (gradient buffers, recomputation, the optimizer's temporaries)."""


@dataclass(frozen=True)
class Affine:
    """Bytes that grow linearly with a count: ``base + per_item x count``, measured at two
    counts (a no-gradient forward's or a decode's peak is affine in its batch: every
    transient scales with it, the weights are not counted)."""

    base: int
    per_item: int

    def at(self, count: int) -> int:
        return self.base + self.per_item * count

    @classmethod
    def through(cls, one: int, count: int, at_count: int) -> Affine:
        """The line through ``(1, one)`` and ``(count, at_count)``."""
        if count <= 1:
            return cls(one, 0)
        per_item = (at_count - one) // (count - 1)
        return cls(one - per_item, per_item)


@dataclass
class Measurements:
    """Everything the planner counted for one configuration (see the module docstring)."""

    checkpoint: str
    family: str
    dtype: str
    components: list[Component]
    height: int
    width: int
    num_frames: int | None
    micro_batch: int
    microgroup: int
    cfg: bool
    train_state: dict[str, int]
    """Per-rank training state at world size 1, by role (``trainable``: the LoRA weights or
    the trained weights' own bytes in full fine-tuning; ``master_copies``; ``gradients``;
    ``optimizer_state``; ``ema``)."""
    step: dict[bool, StepCount] = field(default_factory=dict)
    """The largest micro-batch step over the trained denoisers, by gradient checkpointing
    (False: off, True: on); empty when the family gives no conditioning shapes."""
    largest_block: int = 0
    """The bytes of the trained denoisers' largest repeated block (FSDP's unit)."""
    largest_tensor: int = 0
    """The bytes of the trained components' largest parameter or buffer (what a sharded
    load broadcasts at a time)."""
    sampling: Affine = field(default_factory=lambda: Affine(0, 0))
    """The bytes one sampling forward allocates at its peak (no gradient), by microgroup size."""
    decode: dict[bool, Affine] = field(default_factory=dict)
    """The bytes one VAE decode call allocates at its peak, pixels included, by the outputs
    it decodes at once; by ``--vae-tiling`` (True only when the VAE can tile)."""
    decode_batch_size: int = 1
    """``--vae-decode-batch-size``: outputs one decode call takes (at most a microgroup)."""
    sft_cache_bytes: int = 0
    """An SFT run's host cache of prompt encodings at its bound (0: not SFT)."""
    n_samples_per_prompt: int = 1
    trajectory_bytes: int = 0
    """Host bytes of one sample as the rollout keeps it (trajectory latents in fp32,
    conditioning, pixels)."""
    samples_per_rollout: int = 0
    optimizer_peak: int = 0
    """The bytes the optimizer step allocates at its peak beyond the gradients."""
    notes: list[str] = field(default_factory=list)


def _module_bytes(module: torch.nn.Module) -> tuple[int, int]:
    tensors = [*module.parameters(), *module.buffers()]
    return sum(p.numel() for p in module.parameters()), storage_bytes(tensors)


def _dtype_of(module: torch.nn.Module) -> str:
    dtypes = sorted({DTYPE_NAMES.get(p.dtype, str(p.dtype)) for p in module.parameters()})
    return "+".join(dtypes) or "-"


def _role(name: str, trained: list[str], denoisers: list[str]) -> str:
    if name in trained:
        return "trained"
    if name in denoisers:
        return "denoiser"
    lowered = name.lower()
    if "vae" in lowered or "vocoder" in lowered:
        return "vae"
    return "encoder"


def largest_block_bytes(module: torch.nn.Module) -> int:
    """The bytes of the largest child of a ``ModuleList`` in ``module`` (a transformer
    block, the unit FSDP gathers at a time); the module's own when it has none."""
    blocks = [child for m in module.modules() if isinstance(m, torch.nn.ModuleList) for child in m]
    if not blocks:
        return _module_bytes(module)[1]
    return max(_module_bytes(block)[1] for block in blocks)


@dataclass(frozen=True)
class BlockRun:
    """Consecutive blocks of one ``ModuleList`` with the same structure (class, parameter
    and buffer names, shapes and dtypes): they hold the same bytes for the same inputs."""

    path: str
    """The ``ModuleList``'s name in its module (``transformer_blocks``)."""
    start: int
    length: int


def _signature(block: torch.nn.Module) -> tuple:
    tensors = [*block.named_parameters(), *block.named_buffers()]
    return type(block).__name__, tuple((name, tuple(t.shape), t.dtype) for name, t in tensors)


def block_runs(module: torch.nn.Module) -> list[BlockRun]:
    """The runs of identical blocks in ``module``'s outermost ``ModuleList``s (a
    transformer's block stacks; lists inside a block are part of the block)."""
    runs: list[BlockRun] = []
    inside: list[str] = []
    for name, child in module.named_modules():
        if not isinstance(child, torch.nn.ModuleList) or any(name.startswith(prefix + ".") for prefix in inside):
            continue
        inside.append(name)
        signatures = [_signature(block) for block in child]
        start = 0
        for index in range(1, len(signatures) + 1):
            if index == len(signatures) or signatures[index] != signatures[start]:
                runs.append(BlockRun(name, start, index - start))
                start = index
    return runs


@contextlib.contextmanager
def reduced_depth(module: torch.nn.Module, runs: list[BlockRun], keep: dict[int, int]) -> Iterator[None]:
    """``module`` with run ``i`` of ``runs`` cut to its first ``keep[i]`` blocks (runs
    not in ``keep`` whole), the block order kept; restored on exit."""
    originals: dict[str, torch.nn.ModuleList] = {}
    for path in dict.fromkeys(run.path for run in runs):
        originals[path] = module.get_submodule(path)
    selected: dict[str, list[torch.nn.Module]] = {path: [] for path in originals}
    for index, run in enumerate(runs):
        blocks = list(originals[run.path])[run.start : run.start + run.length]
        selected[run.path].extend(blocks[: keep.get(index, run.length)])
    try:
        for path, blocks in selected.items():
            parent, _, attr = path.rpartition(".")
            setattr(module.get_submodule(parent) if parent else module, attr, torch.nn.ModuleList(blocks))
        yield
    finally:
        for path, original in originals.items():
            parent, _, attr = path.rpartition(".")
            setattr(module.get_submodule(parent) if parent else module, attr, original)


BASE_DEPTH = 2
"""Blocks per run in :func:`by_depth`'s base measurement. At one block a run's first and
last block are the same, and a stack's peak can sit at a point no longer one shows (the
forward's end rather than the backward's start); from two on, every count measured was
affine in the depth (tests/test_planning.py checks the extrapolation against full depth)."""


def by_depth(module: torch.nn.Module, measure: Callable[[], tuple[int, ...]], *, exact: bool = False) -> tuple[int, ...]:
    """``measure()`` of ``module`` at its full depth, from runs at reduced depth: once with
    every longer run of identical blocks cut to :data:`BASE_DEPTH` blocks, then once per
    such run with one block more; each count is affine in a run's length (identical blocks
    hold identical bytes), so the full-depth value is ``base + (length - BASE_DEPTH) x
    (probe - base)`` summed over the runs. ``exact``: measure at full depth instead. A
    model's caches (filled by a first, uncounted call) are left out either way."""
    runs = block_runs(module)
    variable = [i for i, run in enumerate(runs) if run.length > BASE_DEPTH + 1]
    if exact or not variable:
        measure()
        return measure()
    base_keep = {i: BASE_DEPTH for i in variable}
    with reduced_depth(module, runs, base_keep):
        # The first call fills what the model caches across forwards (rotary tables): counted
        # in the base alone, it would tilt every slope.
        measure()
        base = measure()
    total = list(base)
    for i in variable:
        with reduced_depth(module, runs, {**base_keep, i: BASE_DEPTH + 1}):
            probe = measure()
        total = [value + (runs[i].length - BASE_DEPTH) * (p - b) for value, p, b in zip(total, probe, base)]
    return tuple(total)


@contextlib.contextmanager
def _gradient_checkpointing(modules: dict[str, torch.nn.Module], on: bool) -> Iterator[None]:
    before = {name: bool(getattr(m, "gradient_checkpointing", False)) for name, m in modules.items()}
    for module in modules.values():
        if on and hasattr(module, "enable_gradient_checkpointing"):
            module.enable_gradient_checkpointing()
        elif not on and hasattr(module, "disable_gradient_checkpointing"):
            module.disable_gradient_checkpointing()
    try:
        yield
    finally:
        for name, module in modules.items():
            if before[name] and hasattr(module, "enable_gradient_checkpointing"):
                module.enable_gradient_checkpointing()
            elif not before[name] and hasattr(module, "disable_gradient_checkpointing"):
                module.disable_gradient_checkpointing()


def timestep_for(family: Any, component: str, params: Any, num_train_timesteps: int = 1000) -> float:
    """A timestep (on the transformer's scale) at which ``component`` denoises."""
    for step in range(num_train_timesteps, -1, -1):
        if family.denoiser_for(float(step), params) == component:
            return float(step)
    raise CheckpointError(f"no timestep in [0, {num_train_timesteps}] is denoised by {component}")


def plan_request(config: Any, size: int, image: str | None = None) -> Any:
    """A rollout request of ``config``'s run for a microgroup of ``size`` (its step selection
    at seed 0), with conditioning image ``image``."""
    from miles_core.plugin_manager import step_strategy
    from miles_core.rollout.generate import RolloutSettings
    from miles_core.rollout.seeds import Microgroup
    from miles_core.step_strategies import select_steps

    settings = RolloutSettings.from_config(config)
    selection = select_steps(settings, seed=0, epoch=0, strategy=step_strategy(config))
    return settings.request("plan", Microgroup(0, 0, size, 0), selection.sde_steps, selection.return_steps, image=image)


def measure_run(
    config: Any,
    *,
    dtype: torch.dtype,
    optimizer_foreach: bool = True,
    exact_depth: bool = False,
    checkpointing: tuple[bool, ...] = (False, True),
    for_fixes: bool = True,
) -> Measurements:
    """Count what ``config``'s run holds (see the module docstring), its modules in
    ``dtype``; ``config.hf_checkpoint`` must be a local diffusers directory. The
    denoisers' counts come from reduced depths (:func:`by_depth`) unless ``exact_depth``;
    ``optimizer_foreach``: count the optimizer step as on a GPU (torch's multi-tensor
    AdamW), else as on a CPU; ``checkpointing``: the gradient-checkpointing settings whose
    micro-batch is counted (both by default: a fix may turn it on); ``for_fixes``: count
    what a fix may change too, the sampling forward at one output (else only at the
    configured microgroup, and the same bytes are assumed at any smaller one: an
    over-estimate) and the decode with the VAE's tiling (else only with ``--vae-tiling``;
    slow at video sizes), so a plan that fits as configured skips them."""
    from miles_core.family import pipeline_class_for
    from miles_core.model_loading import family_class
    from miles_core.planning.meta_pipeline import build_pipeline_from_configs
    from miles_core.training.run import build_trainer
    from miles_core.training.trainer import target_modules

    checkpoint = Path(config.hf_checkpoint)
    family_cls = family_class(config)
    pipeline = build_pipeline_from_configs(
        checkpoint, pipeline_class_for(family_cls, checkpoint), dtype, family_cls.plan_components(checkpoint)
    )
    family = family_cls(pipeline, device="meta", dtype=dtype)
    denoisers = list(family.components())
    trained = list(target_modules(config, family))
    components = []
    for name, module in pipeline.components.items():
        if isinstance(module, torch.nn.Module):
            count, nbytes = _module_bytes(module)
            components.append(Component(name, type(module).__name__, count, nbytes, _dtype_of(module), _role(name, trained, denoisers)))

    with tempfile.TemporaryDirectory(prefix="miles-plan-") as scratch:
        # A family that requires a conditioning image is planned with one (its latents are
        # part of the conditioning); its pixels do not matter, only that it reads.
        image = _blank_image(Path(scratch)) if family_cls.image_input == "required" else None
        request = plan_request(config, int(config.rollout_microgroup_size), image)
        params = family.resolve_params(request)
    measured = Measurements(
        checkpoint=str(checkpoint),
        family=str(config.model_family),
        dtype=DTYPE_NAMES[dtype],
        components=components,
        height=params.height,
        width=params.width,
        num_frames=params.num_frames,
        micro_batch=int(config.micro_batch_size),
        microgroup=int(config.rollout_microgroup_size),
        cfg=False,
        train_state={},
        largest_block=max(largest_block_bytes(family.components()[name]) for name in trained),
        largest_tensor=max(
            t.numel() * t.element_size()
            for name in trained
            for module in [family.components()[name]]
            for t in (*module.parameters(), *module.buffers())
        ),
        samples_per_rollout=int(config.rollout_batch_size or 1) * int(config.n_samples_per_prompt),
        decode_batch_size=int(config.vae_decode_batch_size),
        n_samples_per_prompt=int(config.n_samples_per_prompt),
    )
    try:
        cond = family.plan_conditioning(params)
    except NotImplementedError as exc:
        measured.notes.append(f"activations, sampling and decode not counted: {exc}")
        cond = None
    steps = int(getattr(pipeline.scheduler, "config", {}).get("num_train_timesteps", 1000))
    if cond is not None:
        measured.cfg = cond.negative is not None
        _measure_rollout(
            measured, family, params, cond, request, denoisers, steps, exact_depth, for_fixes or bool(config.vae_tiling), for_fixes
        )

    trainer = build_trainer(config, family)
    if trainer.loss_spec.trains_on == "supervised_rows" and cond is not None:
        from miles_core.training.trainer import SFT_PROMPT_CACHE_BYTES, SFT_PROMPT_CACHE_ENTRIES

        # SFT has no rollout; its prompt encodings are cached on the host, within a bound.
        per_prompt = storage_bytes([*cond.positive.values(), *(cond.negative or {}).values()])
        measured.sft_cache_bytes = min(SFT_PROMPT_CACHE_BYTES, SFT_PROMPT_CACHE_ENTRIES * per_prompt)
        measured.notes.append("SFT: the VAE encode of a micro-batch's targets is not counted")
    if cond is not None and int(config.sequence_parallel_size) > 1:
        # First: an impossible split is a configuration error, and the family's processors
        # for it (SD3 pads the text to a multiple of the degree) are what the steps run.
        _check_sequence_split(trainer, config, params, cond, steps)
    if cond is not None:
        for checkpointed in checkpointing:
            counts = []
            for name in trained:
                t = timestep_for(family, name, params, steps)
                module = family.components()[name]
                with _gradient_checkpointing(trainer.modules, checkpointed):
                    counts.append(
                        StepCount(*by_depth(module, functools.partial(count_micro_batch, trainer, params, cond, t), exact=exact_depth))
                    )
            measured.step[checkpointed] = max(counts, key=lambda count: count.peak)
    gradients, peak = _optimizer_step(trainer, foreach=optimizer_foreach)
    measured.train_state = _train_state(trainer, config, gradients)
    # The first step's peak holds the state it creates: the plan lists the state apart.
    measured.optimizer_peak = max(0, peak - measured.train_state["optimizer_state"])
    return measured


def _blank_image(directory: Path) -> str:
    from PIL import Image

    path = directory / "image.png"
    Image.new("RGB", (64, 64)).save(path)
    return str(path)


def _latents(family: Any, params: Any, size: int) -> dict[str, torch.Tensor]:
    generators = [torch.Generator().manual_seed(i) for i in range(size)]
    return family.initial_latents(params, generators)


def decode_frame_counts(family: Any, request: Any, params: Any) -> list[tuple[int, Any]]:
    """The second and third frame counts above 1 the family accepts, with their
    parameters, when both are below the configured count (else none: decode as
    configured)."""
    from miles_core.errors import RequestError

    frames = int(params.num_frames or 1)
    valid: list[tuple[int, Any]] = []
    for n in range(2, frames):
        try:
            valid.append((n, family.resolve_params(replace(request, num_frames=n))))
        except RequestError:
            continue
        if len(valid) == 3:
            return valid[1:]
    return []


def _measure_rollout(
    measured: Measurements,
    family: Any,
    params: Any,
    cond: Any,
    request: Any,
    denoisers: list[str],
    steps: int,
    exact: bool,
    tiled_decode: bool,
    microgroup_line: bool,
) -> None:
    """The sampling forward (each denoiser; the largest counts) and the VAE decode, each at
    one output (the sampling only when ``microgroup_line``) and at the configured
    microgroup (or decode batch); the decode with the VAE's tiling too when
    ``tiled_decode``."""
    size = measured.microgroup

    def forward(latents: dict[str, torch.Tensor], group: Any, t: torch.Tensor) -> tuple[int]:
        with torch.no_grad(), fused_attention(), LiveBytes() as live:
            velocity = family.predict(latents, t, group, params)
            del velocity
        return (live.peak,)

    def sampling_peak(count: int) -> int:
        latents, group, peak = _latents(family, params, count), cond.expand(count), 0
        for name in denoisers:
            t = torch.full((count,), timestep_for(family, name, params, steps))
            peak = max(peak, by_depth(family.components()[name], functools.partial(forward, latents, group, t), exact=exact)[0])
        return peak

    def decode_peak(count: int, at: Any) -> int:
        final = family.final_latents(_latents(family, at, count), family.plan_conditioning(at).expand(count), at)
        with torch.no_grad(), fused_attention(), LiveBytes() as live:
            pixels = family.decode(final, at)
            del pixels
        return live.peak

    def decode_rule(count: int) -> int:
        # A video's decode peak is affine in its frames from the second valid frame count
        # on (the causal decoders' first latent frame is special): measured at the second
        # and third, extrapolated (docs/design.md, "Planning memory").
        if len(short) < 2:
            return decode_peak(count, params)
        (n_b, at_b), (n_c, at_c) = short
        p_b, p_c = decode_peak(count, at_b), decode_peak(count, at_c)
        return p_b + (p_c - p_b) * (int(params.num_frames) - n_b) // (n_c - n_b)

    if microgroup_line:
        one = sampling_peak(1)
        measured.sampling = Affine.through(one, size, sampling_peak(size) if size > 1 else one)
    else:
        measured.sampling = Affine(sampling_peak(size), 0)
    short = decode_frame_counts(family, request, params)
    chunk = min(measured.decode_batch_size, size)
    vae = getattr(family.pipeline, "vae", None)
    can_tile = callable(getattr(vae, "enable_tiling", None)) and hasattr(vae, "use_tiling")
    for tiled in [False, True] if tiled_decode and can_tile else [False]:
        vae.use_tiling = tiled
        one = decode_rule(1)
        measured.decode[tiled] = Affine.through(one, chunk, decode_rule(chunk) if chunk > 1 else one)
    if can_tile:
        vae.use_tiling = False
    latents = _latents(family, params, 1)
    per_sample = sum(x.numel() * 4 for x in latents.values())  # the trajectory is kept in fp32
    cond_bytes = storage_bytes([*cond.positive.values(), *(cond.negative or {}).values()])
    pixel_bytes = 3 * (params.num_frames or 1) * params.height * params.width * 4
    measured.trajectory_bytes = len(request.return_steps()) * per_sample + cond_bytes + pixel_bytes


def count_micro_batch(trainer: Any, params: Any, cond: Any, timestep: float) -> tuple[int, int, int]:
    """``(saved, retained, peak)`` of one training micro-batch through its backward, the
    master weights' gradients present."""
    from miles_core.sde import score_streams

    family = trainer.family
    size = int(trainer.config.micro_batch_size)
    x = _latents(family, params, size)
    x_next = {name: torch.zeros_like(v) for name, v in x.items()}
    batch = cond.expand(size)
    t = torch.full((size,), timestep)
    exclude = [tensor for module in family.components().values() for tensor in (*module.parameters(), *module.buffers())]
    # The gradients exist from the step's first micro-batch on (the plan lists them
    # apart); the backward adds into them. Allocating them here instead would move the
    # peak to the backward's end at full depth only, which no reduced depth would show.
    for master in trainer.masters.masters:
        master.grad = torch.zeros_like(master)
    with fused_attention(), LiveBytes() as live:
        with SavedForBackward(exclude=exclude) as saved:
            velocity = family.predict(x, t, batch, params)
            result = score_streams(trainer.backend, x_next, x, velocity, 0.5, 0.45, sigma_max=0.9)
            loss = result.log_prob.float().mean()
        saved_bytes, retained = saved.nbytes, live.current
        loss.backward()
    for master in trainer.masters.masters:
        master.grad = None
    return saved_bytes, retained, live.peak


def _check_sequence_split(trainer: Any, config: Any, params: Any, cond: Any, steps: int) -> None:
    """``--sequence-parallel-size``: the plan exists, the heads divide over the Ulysses
    degree, and one micro-batch's forward at the configured sizes gives every split tensor
    a token count the ranks share (a one-line ConfigError otherwise). It installs the
    plan's processors and size checks on the trained components (diffusers' split is not
    applied: the counts are of whole samples, which the plan divides by the degree)."""
    from miles_core.config.sequence_parallel import ulysses_degree
    from miles_core.training.sequence_parallel import check_split_shapes

    sp = int(config.sequence_parallel_size)
    family = trainer.family
    check_split_shapes(trainer.modules, family, sp, ulysses_degree(sp, int(config.ulysses_degree)))
    size = int(config.micro_batch_size)
    x = _latents(family, params, size)
    for name in trainer.modules:
        t = torch.full((size,), timestep_for(family, name, params, steps))
        with torch.no_grad(), fused_attention():
            family.predict(x, t, cond.expand(size), params)


def _optimizer_step(trainer: Any, *, foreach: bool) -> tuple[int, int]:
    """``(gradients, peak)``: the bytes of every optimizer parameter's gradient, and the
    bytes the first optimizer step allocates at its peak beyond them (the state it creates
    and its temporaries). ``foreach``: the multi-tensor implementation torch picks for
    CUDA tensors (its temporaries span every parameter at once)."""
    for group in trainer.optimizer.param_groups:
        group["foreach"] = foreach
    grads = [torch.zeros_like(master) for master in trainer.masters.masters]
    for master, grad in zip(trainer.masters.masters, grads):
        master.grad = grad
    with LiveBytes() as live:
        trainer.optimizer.step()
    return storage_bytes(grads), live.peak


def _train_state(trainer: Any, config: Any, gradients: int) -> dict[str, int]:
    """The trainer's own tensors at world size 1 once an optimizer step has run."""
    from miles_core.memory import audit_memory

    report = audit_memory(parameters=trainer.parameters, optimizers=[trainer.optimizer], include_meta=True).by_role()
    copies = storage_bytes(trainer.masters.copies())
    state = {
        "trainable": report["parameters"] if config.use_lora else 0,
        "master_copies": copies,
        "gradients": gradients,
        "optimizer_state": report["optimizer_state"] - copies,
    }
    if trainer.ema is not None:
        state["ema"] = storage_bytes(trainer.ema.shadow.values())
    return state


__all__ = [
    "Affine",
    "BlockRun",
    "count_micro_batch",
    "decode_frame_counts",
    "Component",
    "Measurements",
    "StepCount",
    "block_runs",
    "by_depth",
    "largest_block_bytes",
    "measure_run",
    "plan_request",
    "reduced_depth",
    "timestep_for",
]
