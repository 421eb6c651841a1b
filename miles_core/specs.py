"""Spec records: what registration hooks return.

A spec is plain, frozen data: a ``name`` (the registry key), a lazy ``ref``
(``"package.module:object"``) that is imported only when the object is first used,
and metadata the core can act on without importing the object. Registering a spec
has no side effects, so discovering every plugin stays cheap.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar

_REF = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass(frozen=True, kw_only=True)
class Spec:
    """Base of every registration record."""

    kind: ClassVar[str] = ""

    name: str
    """Registry key, lower-case with underscores (``jpeg_compressibility``)."""
    ref: str
    """Lazy reference ``"package.module:object"`` to the implementation."""
    description: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(
                f"{type(self).__name__}.name {self.name!r} must be lower-case letters, digits and underscores, starting with a letter"
            )
        if not isinstance(self.ref, str) or not _REF.match(self.ref):
            raise ValueError(f"{type(self).__name__} {self.name!r}: ref {self.ref!r} must look like 'package.module:object'")

    def check_implementation(self, obj: Any) -> str | None:
        """Why the object :attr:`ref` names contradicts this record (metadata the core
        acts on before importing it), or None. Checked by
        :meth:`~miles_core.registry.Registration.load`."""
        return None

    def metadata(self) -> dict[str, Any]:
        """Plain metadata (everything but name and ref), for listings and ``config``."""
        from dataclasses import asdict

        data = asdict(self)
        data.pop("name")
        data.pop("ref")
        return data


FAMILY_GENERATION_OPTIONS: dict[str, str] = {
    "num_frames": "--diffusion-output-num-frames",
    "fps": "--diffusion-fps",
    "guidance_scale_2": "--diffusion-guidance-scale-2",
    "true_cfg_scale": "--diffusion-true-cfg-scale",
}
"""Generation settings only some families read: option -> the flag that sets it."""


@dataclass(frozen=True, kw_only=True)
class ModelFamilySpec(Spec):
    """A diffusion model family (docs/design.md, "The family contract"). ``ref`` names a
    :class:`miles_core.family.ModelFamily` subclass."""

    kind: ClassVar[str] = "model_family"

    checkpoint_patterns: tuple[str, ...]
    """Case-insensitive substrings of ``--hf-checkpoint`` that select this family when its
    content does not (a hub id, or a pipeline class no installed family lists)."""
    pipeline_classes: tuple[str, ...] = ()
    """The ``_class_name`` values of a diffusers ``model_index.json`` this family serves.
    A local ``--hf-checkpoint`` directory of one of them is this family's when its
    trainable components are there and :attr:`checkpoint_check` (if any) agrees
    (:mod:`miles_core.family_match`). Empty: matched by name patterns only."""
    checkpoint_check: str | None = None
    """Lazy reference ``"package.module:function"`` to ``check(directory, model_index) ->
    str | None``: None when a directory of a listed pipeline class is this family's,
    else why not. For pipeline classes that serve several models (``WanPipeline``). It
    must read JSON with the standard library only (no torch, diffusers, transformers)."""
    trainable_components: tuple[str, ...] = ("transformer",)
    """Pipeline components that training updates and weight sync sends."""
    lora_target_modules: tuple[str, ...]
    """Default ``--lora-target-modules`` (module-name suffixes as PEFT matches them)."""
    lora_target_modules_by_pipeline: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """``(pipeline class, targets)`` pairs for a family whose pipeline classes name their
    layers differently (FLUX.1 and FLUX.2): a local ``--hf-checkpoint`` whose
    ``model_index.json`` names one of them gets those targets by default instead of
    :attr:`lora_target_modules` (which a hub id, read before it is downloaded, gets)."""
    lora_target_modules_for: str | None = None
    """Lazy reference ``"package.module:function"`` to ``targets(directory, model_index) ->
    tuple[str, ...] | None``: a local checkpoint's default targets computed from its
    configuration (block-qualified names whose count depends on the depth: FLUX.2
    [klein]'s ``single_transformer_blocks.N.attn.to_out``), None to keep the static ones.
    It is called before :attr:`lora_target_modules_by_pipeline` is read and must read JSON
    with the standard library only."""
    n_samples_per_prompt: int
    """Recipe group size (GRPO ``n``)."""
    rollout_microgroup_size: int
    """Recipe default for ``--rollout-microgroup-size`` when the flag is unset."""
    max_microgroup_size: int | None = None
    """Largest microgroup the family's forward supports (1 for single-sample forwards)."""
    default_sde_type: str = "sde"
    """``--diffusion-sde-type`` when the flag is unset."""
    supports_cfg_training: bool = True
    """Whether training-side forwards may apply classifier-free guidance."""
    default_guidance_scale: float | None = None
    """``--diffusion-guidance-scale`` when the flag is unset; None keeps the flag's own
    default, or 1 (no guidance) for a family without :attr:`supports_cfg_training`."""
    default_guidance_scale_by_pipeline: tuple[tuple[str, float], ...] = ()
    """``(pipeline class, scale)`` pairs: a local ``--hf-checkpoint`` whose
    ``model_index.json`` names one of them gets that default instead of
    :attr:`default_guidance_scale` (FLUX.2 [klein]'s pipeline defaults to 4.0, FLUX.1
    [dev]'s to 3.5)."""
    sequence_parallel_refusal: str | None = None
    """Why the family's trained components cannot split one sample's tokens over ranks
    (``--sequence-parallel-size`` > 1 is then a configuration error showing it); None
    when they can (:meth:`miles_core.family.ModelFamily.context_parallel_plan`)."""
    generation_options: tuple[str, ...] = ()
    """Family-specific generation settings the family reads, among
    :data:`FAMILY_GENERATION_OPTIONS` (``num_frames``, ``fps`` for video,
    ``guidance_scale_2``, ``true_cfg_scale``). Setting the flag of one the family does
    not list is a configuration error, not a silently ignored value."""
    image_input: str = "none"
    """Whether the family's prompts carry a conditioning image: ``"none"``,
    ``"optional"`` or ``"required"``; the same value as the family class's
    :attr:`~miles_core.family.ModelFamily.image_input`, here so that a run checks its
    prompt rows (``--image-key``) before loading the model."""

    def check_implementation(self, obj: Any) -> str | None:
        """The family class must declare the same :attr:`image_input` as its record: the
        run checks prompt rows by the record, the engine checks requests by the class."""
        declared = getattr(obj, "image_input", "none")
        if declared != self.image_input:
            name = getattr(obj, "__qualname__", repr(obj))
            return f"its class {name} has image_input {declared!r} but the ModelFamilySpec says {self.image_input!r}; they must agree"
        return None

    def __post_init__(self) -> None:
        super().__post_init__()
        for field in ("checkpoint_patterns", "trainable_components", "lora_target_modules"):
            value = getattr(self, field)
            if not isinstance(value, tuple) or not all(isinstance(v, str) and v for v in value):
                raise ValueError(f"ModelFamilySpec {self.name!r}: {field} must be a tuple of strings")
        if not isinstance(self.pipeline_classes, tuple) or not all(isinstance(v, str) and v.isidentifier() for v in self.pipeline_classes):
            raise ValueError(
                f"ModelFamilySpec {self.name!r}: pipeline_classes must be a tuple of class names "
                f"(model_index.json _class_name values), got {self.pipeline_classes!r}"
            )
        if self.checkpoint_check is not None and not (isinstance(self.checkpoint_check, str) and _REF.match(self.checkpoint_check)):
            raise ValueError(
                f"ModelFamilySpec {self.name!r}: checkpoint_check {self.checkpoint_check!r} must look like 'package.module:function'"
            )
        if self.lora_target_modules_for is not None and not (
            isinstance(self.lora_target_modules_for, str) and _REF.match(self.lora_target_modules_for)
        ):
            raise ValueError(
                f"ModelFamilySpec {self.name!r}: lora_target_modules_for {self.lora_target_modules_for!r} must look like "
                "'package.module:function'"
            )
        guidance = self.default_guidance_scale_by_pipeline
        if not isinstance(guidance, tuple) or not all(
            isinstance(pair, tuple)
            and len(pair) == 2
            and pair[0] in self.pipeline_classes
            and not isinstance(pair[1], bool)
            and isinstance(pair[1], (int, float))
            and 0 <= pair[1] < float("inf")
            for pair in guidance
        ):
            raise ValueError(
                f"ModelFamilySpec {self.name!r}: default_guidance_scale_by_pipeline must be (pipeline class, finite "
                f"number >= 0) pairs whose classes are among pipeline_classes {self.pipeline_classes!r}"
            )
        if self.checkpoint_check is not None and not self.pipeline_classes:
            raise ValueError(
                f"ModelFamilySpec {self.name!r}: checkpoint_check needs pipeline_classes (it only runs on a "
                "directory of a listed pipeline class)"
            )
        scale = self.default_guidance_scale
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 <= scale < float("inf")):
            raise ValueError(f"ModelFamilySpec {self.name!r}: default_guidance_scale {scale!r} must be a finite number >= 0")
        if scale is not None and scale > 1 and not self.supports_cfg_training:
            raise ValueError(
                f"ModelFamilySpec {self.name!r}: default_guidance_scale {scale} samples with CFG, which a family "
                "without supports_cfg_training refuses; use 1 or less"
            )
        if self.image_input not in ("none", "optional", "required"):
            raise ValueError(f"ModelFamilySpec {self.name!r}: image_input {self.image_input!r} must be 'none', 'optional' or 'required'")
        unknown = [o for o in self.generation_options if o not in FAMILY_GENERATION_OPTIONS]
        if unknown:
            raise ValueError(f"ModelFamilySpec {self.name!r}: generation_options {unknown} not among {sorted(FAMILY_GENERATION_OPTIONS)}")
        by_pipeline = self.lora_target_modules_by_pipeline
        if not isinstance(by_pipeline, tuple) or not all(
            isinstance(pair, tuple)
            and len(pair) == 2
            and pair[0] in self.pipeline_classes
            and isinstance(pair[1], tuple)
            and pair[1]
            and all(isinstance(v, str) and v for v in pair[1])
            for pair in by_pipeline
        ):
            raise ValueError(
                f"ModelFamilySpec {self.name!r}: lora_target_modules_by_pipeline must be (pipeline class, tuple of "
                f"strings) pairs whose classes are among pipeline_classes {self.pipeline_classes!r}"
            )
        if not self.trainable_components:
            raise ValueError(f"ModelFamilySpec {self.name!r}: trainable_components is empty")
        for field in ("n_samples_per_prompt", "rollout_microgroup_size"):
            if not isinstance(getattr(self, field), int) or getattr(self, field) < 1:
                raise ValueError(f"ModelFamilySpec {self.name!r}: {field} must be a positive int")
        if self.max_microgroup_size is not None and self.rollout_microgroup_size > self.max_microgroup_size:
            raise ValueError(
                f"ModelFamilySpec {self.name!r}: rollout_microgroup_size {self.rollout_microgroup_size} "
                f"exceeds max_microgroup_size {self.max_microgroup_size}"
            )


@dataclass(frozen=True, kw_only=True)
class SdeBackendSpec(Spec):
    """A denoising-step backend (``sde``, ``cps``, ``ode``). ``ref`` names a
    :class:`miles_core.sde.SdeBackend` subclass."""

    kind: ClassVar[str] = "sde_backend"


@dataclass(frozen=True, kw_only=True)
class StepStrategySpec(Spec):
    """Chooses which denoising steps run the SDE and which latents are returned."""

    kind: ClassVar[str] = "step_strategy"


TRAINING_DATA: dict[str, str] = {
    "sde_transitions": "(sample, SDE step) transitions of a rollout with the behaviour policy's log-probabilities "
    "and the samples' advantages (Flow-GRPO's policy_loss, custom_loss)",
    "nft_pairs": "a rollout's final samples with their advantages, re-noised on the forward process at sampled "
    "timesteps; the old policy is an EMA of the live one (DiffusionNFT)",
    "supervised_rows": "data rows (prompt, image or video) of --prompt-data, noised on the forward process; no rollout, no reward (sft_loss)",
    "preference_pairs": "the best and the worst final sample of each rollout group (by reward) as a preference pair, both "
    "re-noised with one noise at one sampled timestep, with the policy's and the reference policy's velocities (online "
    "Diffusion-DPO / Flow-DPO)",
}
"""The kinds of training data a loss can train on: kind -> what it is. The run loop, the
trainer and the configuration rules dispatch on a loss's kind, never on its name; a new
kind comes with its loop in :mod:`miles_core.training.loops` and its batch in the
trainer (docs/plugins.md, "Writing a loss", lists each kind's batch keys)."""

TRANSITION_BATCH_KEYS: dict[str, str] = {
    "mean": "the policy's step mean μ_θ of the transition (primary latent stream), with its gradient",
    "old_mean": "the behaviour policy's step mean μ_old: the trainer's forward with the rollout's weights, "
    "before the rollout's first update (no gradient)",
    "noise_scale": "s, the backend's diffusion coefficient (Flow-GRPO's std_dev_t), shaped [B, 1, ..., 1]",
    "transition_std": "the transition's standard deviation (s·sqrt(−dt) for sde), shaped [B, 1, ..., 1]",
    "sigma": "σ of the step, [B]",
    "sigma_next": "σ' of the step, [B]",
}
"""Optional batch keys a loss that trains on ``sde_transitions`` may ask for
(:attr:`LossSpec.batch_keys`), on top of ``log_prob``, ``old_log_prob`` and ``advantages``."""


@dataclass(frozen=True, kw_only=True)
class LossSpec(Spec):
    """A training loss selectable with ``--loss-type``: what it trains on and what
    reference policy its algorithm needs."""

    kind: ClassVar[str] = "loss"
    trains_on: str = "sde_transitions"
    """A key of :data:`TRAINING_DATA`: the data the run builds for this loss."""
    needs_sde_steps: bool = False
    """True when the loss cannot train without SDE transitions (``policy_loss``): it then
    needs ``--diffusion-num-sde-steps > 0``."""
    keeps_ema: bool = False
    """True when the algorithm itself needs an EMA of the trained weights (DiffusionNFT's
    old policy), whatever ``--use-ema`` says; it is then the default ``--ref-mode``."""
    batch_keys: tuple[str, ...] = ()
    """Keys of :data:`TRANSITION_BATCH_KEYS` the trainer adds to this loss's batch (a loss
    on ``sde_transitions``); ``old_mean`` costs one more forward per transition."""
    needs_reference: bool = False
    """True when the algorithm compares the policy with a reference policy (DPO's
    log-ratios): the run then needs one (``--ref-mode lora_base`` under LoRA, or ``ema``)."""
    min_group_size: int = 1
    """The smallest ``--n-samples-per-prompt`` the algorithm works with (2 for preference
    pairs: a best and a worst sample per group)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        unknown = [k for k in self.batch_keys if k not in TRANSITION_BATCH_KEYS]
        if not isinstance(self.batch_keys, tuple) or unknown:
            raise ValueError(
                f"LossSpec {self.name!r}: batch_keys {list(self.batch_keys)} must be a tuple of {sorted(TRANSITION_BATCH_KEYS)}"
            )
        if self.batch_keys and self.trains_on != "sde_transitions":
            raise ValueError(f"LossSpec {self.name!r}: batch_keys apply to trains_on='sde_transitions' only")
        if isinstance(self.min_group_size, bool) or not isinstance(self.min_group_size, int) or self.min_group_size < 1:
            raise ValueError(f"LossSpec {self.name!r}: min_group_size must be a positive int")
        if self.trains_on not in TRAINING_DATA:
            raise ValueError(f"LossSpec {self.name!r}: trains_on {self.trains_on!r} is not one of {sorted(TRAINING_DATA)}")
        if self.needs_sde_steps and self.trains_on != "sde_transitions":
            raise ValueError(f"LossSpec {self.name!r}: needs_sde_steps applies to trains_on='sde_transitions' only")


@dataclass(frozen=True, kw_only=True)
class RewardSpec(Spec):
    """A reward model selectable with ``--rm-type``. ``ref`` names a class built as
    ``cls(config)`` and called as ``reward(outputs, prompts, metadata) -> list[float]``."""

    kind: ClassVar[str] = "reward"
    modality: tuple[str, ...] = ("image", "video")
    """Which outputs it can score."""
    uses_gpu: bool = False
    """It runs a model that wants a GPU: under ``--use-ray`` on a GPU cluster each reward
    worker then gets one GPU unless ``--reward-num-gpus-per-worker`` says otherwise (a
    weight-free reward's workers get none)."""


@dataclass(frozen=True, kw_only=True)
class RolloutFilterSpec(Spec):
    """A rollout filter: ``stage`` is ``group`` (dynamic sampling), ``sample`` (loss
    mask) or ``buffer`` (buffer selection)."""

    kind: ClassVar[str] = "rollout_filter"
    stage: str

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.stage not in ("group", "sample", "buffer"):
            raise ValueError(f"RolloutFilterSpec {self.name!r}: stage {self.stage!r} must be group, sample or buffer")


@dataclass(frozen=True, kw_only=True)
class RolloutEngineSpec(Spec):
    """A rollout engine selectable with ``--rollout-engine``."""

    kind: ClassVar[str] = "rollout_engine"
    remote: bool = False
    """True when the engine runs outside the trainer's process (weights cross a boundary)."""
    releases_memory: bool = False
    """True when the engine can release its memory while the trainer trains and resume it
    (``--offload-rollout``, on under ``--offload`` and ``--colocate``); an engine that
    cannot is refused with those flags."""


SPEC_TYPES: dict[str, type[Spec]] = {
    cls.kind: cls
    for cls in (
        ModelFamilySpec,
        SdeBackendSpec,
        StepStrategySpec,
        LossSpec,
        RewardSpec,
        RolloutFilterSpec,
        RolloutEngineSpec,
    )
}
"""Every registry kind, keyed by ``Spec.kind``."""
