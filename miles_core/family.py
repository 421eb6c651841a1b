"""The model-family contract (docs/design.md, "The family contract").

A family plugin registers a :class:`~miles_core.specs.ModelFamilySpec` whose ``ref``
names a :class:`ModelFamily` subclass. The class side loads pipelines, builds tiny ones
and reads native sizes; an instance wraps one loaded pipeline and runs the denoising
prediction. **The same instance methods serve the rollout engine and the trainer**, so
both compute the same velocity for the same inputs.

This module stays import-light: torch and diffusers are imported inside the methods that
need them, so resolving a family (for example to read its native size while validating a
configuration) loads no model code.
"""

from __future__ import annotations

import abc
import importlib
import inspect
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch
    from diffusers import DiffusionPipeline

    from miles_core.conditioning_image import ConditioningImage
    from miles_core.request import RolloutRequest

Latents = dict[str, "torch.Tensor"]
"""Named latent streams, batch first (``{"latents": x}``; LTX-2 adds ``audio_latents``)."""


@dataclass(frozen=True)
class GenerationParams:
    """A request's sampling parameters with the family's defaults filled in."""

    height: int
    width: int
    num_inference_steps: int
    guidance_scale: float
    num_frames: int | None = None
    fps: float | None = None
    true_cfg_scale: float | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Family-specific parameters (``extra_sampling_params``, e.g. ``guidance_scale_2``)."""
    flow_shift: float | None = None
    """Flow-matching shift of the sampling schedule, ``σ' = s·σ / (1 + (s − 1)·σ)``
    (``extra_sampling_params.flow_shift``); None: the checkpoint scheduler's own config."""
    image: ConditioningImage | None = None
    """The request's conditioning image (``image_path``), set by ``resolve_params`` of a
    family that takes one (:func:`~miles_core.conditioning_image.request_image`). Only
    the engine side sees it: :meth:`ModelFamily.encode` turns it into conditioning
    tensors, and the trainer's parameters (rebuilt from ``denoising_env``) carry none, so
    ``predict`` and :meth:`ModelFamily.final_latents` must read the image from the
    conditioning."""


@dataclass
class Conditioning:
    """What the denoiser needs besides latents and timestep, batch first.

    ``positive`` and ``negative`` map keyword names of the transformer call (for SD3
    ``encoder_hidden_states``, ``pooled_projections``) to tensors; ``negative`` is None
    when classifier-free guidance is off. Encoded once per request with batch 1, then
    expanded to the request's outputs.
    """

    positive: dict[str, torch.Tensor]
    negative: dict[str, torch.Tensor] | None = None

    def expand(self, n: int) -> Conditioning:
        """Repeat every row ``n`` times (``repeat_interleave``), for ``n`` outputs."""

        def rep(tensors: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
            return None if tensors is None else {k: v.repeat_interleave(n, dim=0) for k, v in tensors.items()}

        return Conditioning(rep(self.positive), rep(self.negative))  # type: ignore[arg-type]

    def row(self, i: int) -> Conditioning:
        """Output ``i``'s conditioning, batch 1."""

        def take(tensors: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
            return None if tensors is None else {k: v[i : i + 1] for k, v in tensors.items()}

        return Conditioning(take(self.positive), take(self.negative))  # type: ignore[arg-type]

    @staticmethod
    def cat(parts: Sequence[Conditioning]) -> Conditioning:
        """Concatenate along the batch (the trainer's micro-batches); parts must hold the
        same tensor names (a ValueError naming both sets otherwise)."""
        import torch

        def join(key: str) -> dict[str, torch.Tensor] | None:
            values = [getattr(p, key) for p in parts]
            if any(v is None for v in values):
                if not all(v is None for v in values):
                    raise ValueError("cannot batch conditionings with and without a negative prompt")
                return None
            keys = set(values[0])
            for value in values[1:]:
                if set(value) != keys:
                    # An image-conditioned row and a text-only one: never one batch.
                    raise ValueError(f"cannot batch conditionings with different {key} tensors: {sorted(keys)} and {sorted(value)}")
            return {k: torch.cat([v[k] for v in values], dim=0) for k in values[0]}

        return Conditioning(join("positive"), join("negative"))  # type: ignore[arg-type]


@dataclass(frozen=True)
class Schedule:
    """The denoising schedule of one request."""

    timesteps: torch.Tensor
    """[T]: the transformer's timestep input at each loop step."""
    sigmas: torch.Tensor
    """[T + 1] flow-matching sigmas (shift applied), from 1 down to a terminal 0."""


class ModelFamily(abc.ABC):
    """One family of diffusers pipelines.

    Class side: :attr:`pipeline_class`, :meth:`load_pipeline`,
    :meth:`build_tiny_pipeline`, :meth:`native_size`. Instance side (a loaded pipeline,
    used by the engine and the trainer alike): :meth:`resolve_params`, :meth:`encode`,
    :meth:`initial_latents`, :meth:`schedule`, :meth:`predict`, :meth:`decode`.
    """

    pipeline_class: ClassVar[str]
    """The diffusers pipeline class, ``"diffusers:StableDiffusion3Pipeline"``."""
    latent_streams: ClassVar[tuple[str, ...]] = ("latents",)
    """Names of the latent streams, the primary one first."""
    audio_latent_streams: ClassVar[tuple[str, ...]] = ()
    """The latent streams :meth:`encode_audio` fills (LTX-2: ``audio_latents``); the
    others come from :meth:`encode_pixels`. SFT rows of such a family need an audio file."""
    batched_outputs: ClassVar[bool] = True
    """False when the forward has no batch dimension (Cosmos 3): the engine loops."""
    image_input: ClassVar[str] = "none"
    """Whether requests carry a conditioning image (``image_path``): ``"none"`` (text
    only; an image is refused), ``"optional"`` (Wan 2.2 TI2V-5B: text- or image-to-video)
    or ``"required"`` (Wan 2.2 I2V-A14B). A family that takes one sets
    ``GenerationParams.image`` in :meth:`resolve_params` and encodes it in :meth:`encode`."""
    tiny_variants: ClassVar[tuple[str, ...]] = ()
    """Names :meth:`build_tiny_pipeline` takes as ``variant`` (``make-tiny --variant``), the
    default first; empty when the family builds one kind of tiny pipeline."""

    def __init__(self, pipeline: DiffusionPipeline, *, device: Any = "cpu", dtype: Any = None) -> None:
        import torch

        self.pipeline = pipeline
        self.device = torch.device(device)
        self.dtype = dtype or torch.float32
        modules = {name: c for name, c in pipeline.components.items() if isinstance(c, torch.nn.Module)}
        deferred = {name for name, module in modules.items() if any(p.is_meta for p in module.parameters())}
        if deferred:
            # A sharded trainer's rank builds the components it trains on the meta device and
            # materialises only its shard later (miles_core.training.rank_loading).
            for name, module in modules.items():
                if name not in deferred:
                    module.to(self.device)
        else:
            pipeline.to(self.device)
        from miles_core.memory import own_storages

        # Weights memory-mapped from safetensors files get storages of their own, so that
        # offloading (which releases storages) never moves them: see own_storages.
        own_storages(value for value in pipeline.components.values() if isinstance(value, torch.nn.Module))

    @classmethod
    def from_pretrained(cls, checkpoint: str | Path, *, device: Any = "cpu", dtype: Any = None) -> ModelFamily:
        """Load the pipeline with :meth:`load_pipeline` and wrap it."""
        import torch

        return cls(cls.load_pipeline(checkpoint, dtype=dtype or torch.float32), device=device, dtype=dtype)

    # -- instance side: the prediction contract ---------------------------------------

    @abc.abstractmethod
    def components(self) -> dict[str, torch.nn.Module]:
        """The pipeline's trainable components by name (``transformer`` ...)."""

    @abc.abstractmethod
    def resolve_params(self, request: RolloutRequest) -> GenerationParams:
        """Fill the request's unset sizes and options with the pipeline's defaults and
        check them; a bad value raises :class:`~miles_core.request.RequestError`
        naming the field."""

    @abc.abstractmethod
    def encode(self, prompt: str, negative_prompt: str | None, params: GenerationParams) -> Conditioning:
        """Encode the prompt (and the negative prompt when guidance needs it) once,
        with batch 1."""

    @abc.abstractmethod
    def initial_latents(self, params: GenerationParams, generators: Sequence[torch.Generator]) -> Latents:
        """Initial noise, output *i* drawn in fp32 from ``generators[i]`` (seeded
        ``seed + i``) on that generator's device (:func:`per_output_noise`) and then moved
        to the model's device, so any engine that follows the same rule starts a sample
        from the same noise. The generators are CPU ones unless the request's
        ``generator_device`` is ``cuda`` (then on the model's device)."""

    @abc.abstractmethod
    def schedule(self, params: GenerationParams) -> Schedule:
        """Timesteps and sigmas of the sampling loop (shift applied)."""

    @abc.abstractmethod
    def predict(self, latents: Latents, timestep: torch.Tensor, cond: Conditioning, params: GenerationParams) -> Latents:
        """The velocity for every stream, guidance included. ``timestep`` is ``[B]`` on
        the transformer's scale; rows are independent (the trainer mixes steps)."""

    def plan_conditioning(self, params: GenerationParams) -> Conditioning:
        """What :meth:`encode` returns for one sample at its largest, by shape: every prompt
        at the longest length the family encodes (``max_sequence_length`` or the text
        encoder's limit), the negative one too when guidance needs it, a conditioning
        image's latents for a family that takes one; zero tensors on :attr:`device` in the
        dtypes :meth:`encode` gives. The memory planner (:mod:`miles_core.planning`) calls
        it on a pipeline built on the meta device, whose text encoders cannot run without
        their tokenizers; it must not read tensor values. Families that do not implement it
        are planned without activations (the plan says so)."""
        raise NotImplementedError(f"the {type(self).__name__} family does not give its conditioning's shapes (plan_conditioning)")

    def trainable_parameters(self, component: str) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """The ``(name, parameter)`` pairs of ``component`` (a key of :meth:`components`)
        that full fine-tuning (no LoRA) trains; the rest of the component stays frozen.
        Default: all of them (Cosmos 3 keeps its understanding tower out)."""
        return self.components()[component].named_parameters()

    def denoiser_for(self, timestep: torch.Tensor | float, params: GenerationParams) -> str:
        """The name (a key of :meth:`components`) of the trainable component that
        predicts at ``timestep`` (one timestep, on the transformer's scale).

        The trainer records it on every train pair and never puts pairs of two
        denoisers in one micro-batch, so one forward runs one expert: Wan 2.2 answers
        ``transformer`` at or above ``boundary_ratio x num_train_timesteps`` and
        ``transformer_2`` below. Default: the first trainable component (families
        with a single denoiser need not override it)."""
        return next(iter(self.components()))

    def context_parallel_plan(self, component: str, module: torch.nn.Module, degree: int) -> dict[str, Any] | None:
        """How sequence parallelism (``--sequence-parallel-size`` = ``degree`` > 1) splits
        and gathers the tokens of trainable ``component`` (``module``) in its forward: a
        plan in diffusers' ``_cp_plan`` format (submodule name -> ``ContextParallelInput``
        for each input or output to split, or ``ContextParallelOutput`` to gather), which
        the trainer applies with diffusers' context-parallel hooks. Called once per
        trained component on every rank, before sharding; a family may prepare the module
        here (attention processors that dispatch through diffusers' attention backends, a
        hook that pads a sequence to a multiple of ``degree``). Every attention processor
        must then dispatch through ``diffusers.models.attention_dispatch``. Default: the
        module's own ``_cp_plan``; None when it has none (sequence parallelism is refused)."""
        return getattr(module, "_cp_plan", None)

    @abc.abstractmethod
    def decode(self, latents: Latents, params: GenerationParams) -> torch.Tensor:
        """Final latents to pixels in [0, 1]: ``[B, C, H, W]`` or ``[B, C, F, H, W]``."""

    def enable_vae_tiling(self) -> None:
        """``--vae-tiling``: make :meth:`decode` (and :meth:`encode_pixels`) use the VAE's
        own spatial tiling. Default: ``pipeline.vae.enable_tiling()``, diffusers' tiling
        with the VAE's default tile sizes; a VAE without it raises
        :class:`~miles_core.errors.ConfigError`. A family that decodes with another
        module overrides it."""
        from miles_core.errors import ConfigError

        vae = getattr(self.pipeline, "vae", None)
        try:
            if not callable(getattr(vae, "enable_tiling", None)):
                raise NotImplementedError
            vae.enable_tiling()  # diffusers raises NotImplementedError where the VAE has no tiled path
        except NotImplementedError:
            raise ConfigError(
                f"--vae-tiling: the {type(self).__name__} family's VAE ({type(vae).__name__}) has no tiled decode "
                "(diffusers' enable_tiling); leave the flag off"
            ) from None

    def encode_pixels(self, pixels: torch.Tensor, params: GenerationParams) -> Latents:
        """Pixels in [0, 1] (``[B, C, H, W]`` or ``[B, C, F, H, W]``) to clean latents
        ``x0``, the inverse of :meth:`decode`; used by SFT. Families that support SFT
        override it."""
        raise NotImplementedError(f"the {type(self).__name__} family cannot encode pixels (no SFT support yet)")

    def encode_audio(self, waveform: torch.Tensor, sample_rate: int, params: GenerationParams) -> Latents:
        """A waveform in [-1, 1], ``[B, channels, samples]`` at ``sample_rate`` Hz, to the
        clean latents of :attr:`audio_latent_streams` for a clip of ``params``' length
        (``num_frames / fps`` seconds from the start); used by SFT, which passes the
        file's first ``num_frames / fps`` seconds plus up to one more (for a resampler's
        look-ahead; less where the file ends) and checks from the file's header, before
        training, that it holds ``round(num_frames / fps x sample_rate)`` samples. Optional:
        only a family with an audio stream implements it. A waveform the family cannot use (too
        short, wrong channel count) raises ``ValueError`` whose message continues
        "audio FILE ..." (for example "lasts 0.2 s; the clip needs 0.375 s")."""
        raise NotImplementedError(f"the {type(self).__name__} family has no audio stream to encode")

    def save_lora(self, directory: str | Path, modules: Mapping[str, torch.nn.Module]) -> Path:
        """Write the LoRA adapters of ``modules`` (component name -> PEFT-adapted module)
        as a diffusers LoRA that ``pipeline.load_lora_weights(directory)`` loads."""
        from peft.utils import get_peft_model_state_dict

        pipeline_cls = type(self.pipeline)
        if not hasattr(pipeline_cls, "save_lora_weights"):
            raise NotImplementedError(f"{pipeline_cls.__name__} has no diffusers LoRA format (save_lora_weights)")
        layers: dict[str, Any] = {}
        for name, module in modules.items():
            layers[f"{name}_lora_layers"] = get_peft_model_state_dict(module)
            # The adapter's config (rank, alpha, targets) travels as metadata; without it
            # diffusers loads the LoRA with alpha = rank, i.e. at the wrong strength.
            config = getattr(module, "peft_config", {}).get("default")
            if config is not None:
                layers[f"{name}_lora_adapter_metadata"] = config.to_dict()
        pipeline_cls.save_lora_weights(str(directory), **layers)
        return Path(directory)

    def load_lora(self, directory: str | Path) -> Any:
        """Load a LoRA that :meth:`save_lora` wrote into the pipeline (``generate --lora``):
        ``pipeline.load_lora_weights(directory)``. Families whose pipeline has no LoRA
        loader override it (Cosmos 3 loads through its transformer's adapter API)."""
        return self.pipeline.load_lora_weights(str(directory))

    def final_latents(self, latents: Latents, cond: Conditioning, params: GenerationParams) -> Latents:
        """The latents :meth:`decode` and :meth:`extra_outputs` take, from the last state of
        the denoising loop. Default: the state itself. A family whose state leaves out
        latents it does not denoise puts them back here (Wan 2.2 TI2V-5B with an image
        denoises frames 1.. and prepends the image's latent frame from ``cond``)."""
        return latents

    def extra_outputs(self, latents: Latents, params: GenerationParams) -> dict[str, torch.Tensor]:
        """Further decoded outputs per sample, batch first (LTX-2's audio); none by default."""
        return {}

    # -- class side -------------------------------------------------------------------

    @classmethod
    def resolve_pipeline_class(cls, checkpoint: str | Path | None = None) -> type[DiffusionPipeline]:
        """The diffusers class :meth:`load_pipeline` loads ``checkpoint`` with:
        :attr:`pipeline_class`. A family serving several pipeline classes (FLUX) overrides
        it to read the checkpoint's ``model_index.json``."""
        module_name, _, attr = cls.pipeline_class.partition(":")
        return getattr(importlib.import_module(module_name), attr)

    @classmethod
    def load_pipeline(cls, checkpoint: str | Path, *, dtype: Any = None, **kwargs: Any) -> DiffusionPipeline:
        """Load the family's pipeline with ``from_pretrained`` from a local directory or
        hub id (``model_index.json`` layout). A local path that does not exist is a
        :class:`~miles_core.errors.CheckpointError` saying so, not a hub lookup. A tiny
        pipeline loads with the hub libraries quiet, anything else with their progress
        bars and warnings (:func:`~miles_core.quiet.quiet_hub_load`)."""
        from miles_core.errors import CheckpointError
        from miles_core.family_match import checkpoint_problem, missing_weights
        from miles_core.quiet import quiet_hub_load

        problem = checkpoint_problem(checkpoint)
        if problem is None and Path(checkpoint).is_dir():
            problem = missing_weights(checkpoint)
        if problem is not None:
            raise CheckpointError(f"{cls.__name__}: checkpoint {problem}")
        pipeline_cls = pipeline_class_for(cls, checkpoint)
        if dtype is not None:
            kwargs["dtype"] = dtype  # diffusers' name since 0.36 (torch_dtype is deprecated)
        with quiet_hub_load(checkpoint):
            return pipeline_cls.from_pretrained(str(checkpoint), **kwargs)

    @classmethod
    def build_tiny_pipeline(cls, out_dir: str | Path, *, seed: int = 0) -> Path:
        """Write a randomly initialised, tiny version of the family's real pipeline
        (real classes, tiny configs, locally built tokenizers; nothing downloaded) to
        ``out_dir`` with ``save_pretrained``, deterministically for a given ``seed``.
        A family with :attr:`tiny_variants` also takes ``variant=`` (one of them).
        Returns the directory. ``pipeline_class.from_pretrained(out_dir)`` loads it."""
        raise NotImplementedError(f"{cls.__name__} has no tiny pipeline factory")

    @classmethod
    def plan_components(cls, checkpoint: str | Path) -> dict[str, Any]:
        """Pipeline components the memory planner cannot build from the checkpoint's
        configuration files but the pipeline's constructor reads (Cosmos 3's tokenizer, for
        its special tokens' ids), by ``__init__`` argument name; they must hold no weights.
        Default: none (tokenizers and processors are ``None`` in a planned pipeline)."""
        return {}

    @classmethod
    def native_size(cls, checkpoint: str | Path) -> tuple[int, int] | None:
        """The ``(height, width)`` the pipeline produces when none is asked for, as
        diffusers resolves it, or ``None`` when it cannot be told without loading the
        model (for example a hub id). Reads only JSON files."""
        return None


def pipeline_class_for(family: type[ModelFamily], checkpoint: str | Path) -> type[DiffusionPipeline]:
    """``family.resolve_pipeline_class(checkpoint)``: the diffusers class that loads
    ``checkpoint``. An override written before the method took the checkpoint (no
    ``checkpoint`` parameter) is called without it."""
    resolve = family.resolve_pipeline_class
    if "checkpoint" in inspect.signature(resolve).parameters:
        return resolve(checkpoint)
    return resolve()


def flow_shift_key(scheduler: Any) -> str | None:
    """The scheduler config's flow-matching shift option: ``flow_shift`` (UniPC or
    DPM-Solver in flow-sigma mode) or ``shift`` (FlowMatchEuler); None when it has none."""
    config = scheduler.config
    if "flow_shift" in config and config.get("use_flow_sigmas", False):
        return "flow_shift"
    return "shift" if "shift" in config else None


def scheduler_copy(scheduler: Any, flow_shift: float | None = None) -> Any:
    """A private copy of a pipeline's scheduler (``set_timesteps`` mutates it, and
    requests run concurrently), rebuilt from its config with ``flow_shift`` when given:
    diffusers derives parts of the sigma grid from the shift in ``__init__``, so setting
    it afterwards would not match a scheduler built with it; an explicit shift replaces
    a dynamic (resolution-dependent) one. ``ValueError`` for a scheduler without a shift."""
    import copy

    if flow_shift is None:
        return copy.deepcopy(scheduler)
    key = flow_shift_key(scheduler)
    if key is None:
        raise ValueError(f"{type(scheduler).__name__} has no shift")
    overrides: dict[str, Any] = {key: flow_shift}
    if "use_dynamic_shifting" in scheduler.config:
        overrides["use_dynamic_shifting"] = False
    return type(scheduler).from_config(scheduler.config, **overrides)


FIRST_SIGMA_GUARD = 1e-5


def exact_first_sigma(sigmas: torch.Tensor) -> torch.Tensor:
    """``sigmas`` with a first sigma that UniPC / DPM-Solver lowered from 1 to keep their
    multistep arithmetic finite (1 - 1e-6) put back to exactly 1: families step with
    Euler / Flow-GRPO SDE steps, where that guard would defeat the SDE's sigma = 1 rule
    (the first step's noise scale ``sqrt(sigma / (1 - sigma))`` would be ~1000x too large)."""
    sigmas = sigmas.clone()
    if 0 < 1 - float(sigmas[0]) <= FIRST_SIGMA_GUARD:
        sigmas[0] = 1.0
    return sigmas


def request_size(
    name: str, value: int | None, default: int, multiple: int, *, rule: str = "", limit: int | None = None, limit_rule: str = ""
) -> int:
    """A request's ``height`` or ``width`` for :meth:`ModelFamily.resolve_params`:
    ``default`` when unset; it must be a multiple of ``multiple`` (``rule``: why, appended
    to the message) and at most ``limit`` when one is given (``limit_rule`` likewise).
    :class:`~miles_core.request.RequestError` naming the field otherwise."""
    from miles_core.errors import RequestError

    value = default if value is None else value
    if value % multiple:
        raise RequestError(name, f"{value} must be a multiple of {multiple}{rule}")
    if limit is not None and value > limit:
        raise RequestError(name, f"{value} exceeds the transformer's maximum of {limit}{limit_rule}")
    return value


def request_extras(request: Any, known: Sequence[str], *, family: str) -> dict[str, Any]:
    """A copy of the request's ``extra_sampling_params`` once every key is one of
    ``known`` (listed in the message in the order given); a
    :class:`~miles_core.request.RequestError` naming the family otherwise."""
    from miles_core.errors import RequestError

    extra = dict(request.extra_sampling_params)
    unknown = sorted(set(extra) - set(known))
    if unknown:
        listing = " and ".join(known) if len(known) == 2 else ", ".join(known)
        raise RequestError("extra_sampling_params", f"{family} takes only {listing}, got {', '.join(unknown)}")
    return extra


def check_flow_shift(scheduler: Any, flow_shift: float | None, *, what: str = "shift") -> None:
    """Refuse a requested flow shift the pipeline's scheduler has no option for (see
    :func:`flow_shift_key`)."""
    from miles_core.errors import RequestError
    from miles_core.request import FLOW_SHIFT

    if flow_shift is not None and flow_shift_key(scheduler) is None:
        raise RequestError("extra_sampling_params", f"{FLOW_SHIFT}: the pipeline's {type(scheduler).__name__} has no {what}")


def request_max_sequence_length(extra: Mapping[str, Any], default: int | None, limit: int | None, key: str = "max_sequence_length") -> int:
    """``extra[key]`` (``default`` when absent): an integer in ``[1, limit]``, or any
    positive integer without a ``limit``."""
    from miles_core.errors import RequestError

    length = extra.get(key, default)
    valid = not isinstance(length, bool) and isinstance(length, int) and length >= 1 and (limit is None or length <= limit)
    if not valid:
        rule = "a positive integer" if limit is None else f"an integer in [1, {limit}]"
        raise RequestError("extra_sampling_params", f"{key} must be {rule}, got {length!r}")
    return length


def request_fps(value: float | None, default: float | None) -> float | None:
    """A request's ``fps``: ``default`` when unset, else a finite number above 0
    (:class:`~miles_core.request.RequestError` otherwise)."""
    import math

    from miles_core.errors import RequestError

    if value is None:
        return default
    if not (math.isfinite(value) and value > 0):
        raise RequestError("fps", f"must be a finite number > 0, got {value!r}")
    return float(value)


def per_output_noise(shape: Sequence[int], generators: Sequence[torch.Generator]) -> torch.Tensor:
    """``[len(generators), *shape[1:]]`` fp32 noise: one ``torch.randn(shape)`` draw per
    output from that output's own generator, on the generator's device (``shape`` has a
    leading 1), so an output's noise depends only on its seed and its generator's device
    (the CPU by default: then never on the model's device), never on its batch. What the
    diffusers pipelines' ``randn_tensor`` with a list of generators draws, row by row."""
    import torch

    return torch.cat([torch.randn(tuple(shape), generator=g, device=g.device, dtype=torch.float32) for g in generators])


def read_component_config(checkpoint: str | Path, component: str) -> dict[str, Any] | None:
    """``<checkpoint>/<component>/config.json`` as a dict, or ``None`` when the
    checkpoint is not a local diffusers directory."""
    path = Path(checkpoint) / component / "config.json"
    if not path.is_file():
        return None
    with path.open(encoding="utf-8") as handle:
        return json.load(handle)
