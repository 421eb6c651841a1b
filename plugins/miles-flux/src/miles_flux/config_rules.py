"""The FLUX rules a command line can break, checked while it is resolved.

Called by :func:`miles_flux.plugin.miles_validate_config` with the resolved configuration
and what :func:`miles_flux.checkpoint.read_checkpoint` read of ``--hf-checkpoint``
(None when it could not tell). Standard library only (and, for a FLUX.2 [dev] checkpoint,
the import-light :mod:`miles_flux.flux2` for its refusal): it runs before anything heavy
is imported. Each rule gives one line naming the flag, its value and the rule:

- ``--diffusion-height`` / ``--diffusion-width`` must be multiples of the VAE factor times
  the 2x2 latent packing (16 for the released models);
- FLUX.2 [dev] (``Flux2Pipeline``) is not served (:data:`miles_flux.flux2.FLUX2_DEV_REFUSAL`
  says why): refused here, before its weights are downloaded or loaded;
- ``--diffusion-true-cfg-scale`` is FLUX.1's (``FluxPipeline.true_cfg_scale``);
  FLUX.2 [klein] has no such option;
- a ``--diffusion-guidance-scale`` set above 1 where the pipeline ignores it (a
  step-distilled FLUX.2 [klein], a FLUX.1 transformer without ``guidance_embeds``);
- sglang-diffusion's CFG parallelism on a run that has no unconditional branch: it gives
  half the GPUs to a branch that a guidance-distilled FLUX never computes.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from miles_flux.checkpoint import FLUX1, FLUX2, KLEIN, PIPELINES, FluxCheckpoint

RELEASED_SIZE_MULTIPLE = 16
"""The size multiple when the checkpoint cannot be read: every released FLUX VAE
downsamples 8x, times the 2x2 packing."""

CFG_PARALLEL_SWITCH = "--sglang-enable-cfg-parallel"
"""sglang-diffusion's ``--enable-cfg-parallel`` as the run passes it through."""
CFG_PARALLEL_SIZES = ("--sglang-cfg-parallel-size",)
"""sglang-diffusion's ``--cfg-parallel-size N``, which supersedes the switch (on when N > 1)."""
FALSE_WORDS = frozenset({"false", "0", "no", "off"})


def _user_set(config: Any, dest: str) -> bool:
    is_user_set = getattr(config, "is_user_set", None)
    return bool(is_user_set(dest)) if is_user_set is not None else getattr(config, dest, None) is not None


def _value(config: Any, dest: str) -> str:
    value = getattr(config, dest, None)
    return "it is unset" if value is None else f"it is {value}"


def _model(checkpoint: FluxCheckpoint | None) -> str:
    if checkpoint is None:
        return "this FLUX checkpoint"
    if checkpoint.pipeline == KLEIN:
        return f"{checkpoint.name} ({'step-distilled' if checkpoint.step_distilled else 'base'})"
    return checkpoint.name


def cfg_parallel_argument(sglang_args: Sequence[str]) -> str | None:
    """The pass-through argument that turns sglang-diffusion's CFG parallelism on, as
    typed (``--flag value`` or ``--flag=value``); None when none does."""
    found = None
    tokens = list(sglang_args)
    for i, token in enumerate(tokens):
        if not token.startswith("--"):
            continue
        name, eq, value = token.partition("=")
        if not eq and i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            value, shown = tokens[i + 1], f"{token} {tokens[i + 1]}"
        else:
            shown = token
        if name == CFG_PARALLEL_SWITCH:
            # A switch: bare means on; sglang's boolean flags also take true/false.
            found = None if value.strip().lower() in FALSE_WORDS else shown
        elif name in CFG_PARALLEL_SIZES:
            try:
                found = shown if int(value) > 1 else None
            except ValueError:
                continue  # not a number: sglang-diffusion reports it
    return found


def _size_errors(config: Any, checkpoint: FluxCheckpoint | None) -> list[str]:
    if checkpoint is None:
        multiple, why = RELEASED_SIZE_MULTIPLE, "the released FLUX VAEs' 8x downsampling times the 2x2 latent packing"
    else:
        multiple = checkpoint.size_multiple
        why = f"{checkpoint.name}'s {checkpoint.vae_scale_factor}x VAE downsampling times the 2x2 latent packing"
    errors = []
    for flag, dest in (("--diffusion-height", "diffusion_height"), ("--diffusion-width", "diffusion_width")):
        value = getattr(config, dest, None)
        if value is not None and value % multiple:
            errors.append(f"{flag} {value}: FLUX sizes must be multiples of {multiple} ({why})")
    return errors


def _has_unconditional_branch(config: Any, checkpoint: FluxCheckpoint | None) -> bool:
    """Whether sampling makes a second, unconditional transformer call per step."""
    pipeline = checkpoint.pipeline if checkpoint is not None else FLUX1
    if pipeline == FLUX1:
        return (getattr(config, "diffusion_true_cfg_scale", None) or 0.0) > 1
    if pipeline == KLEIN and checkpoint is not None and not checkpoint.step_distilled:
        return (getattr(config, "diffusion_guidance_scale", None) or 0.0) > 1
    return False


def _cfg_parallel_error(argument: str, config: Any, checkpoint: FluxCheckpoint | None) -> str:
    prefix = f"{argument}: sglang-diffusion's CFG parallelism gives half the GPUs to an unconditional branch, and {_model(checkpoint)} "
    pipeline = checkpoint.pipeline if checkpoint is not None else FLUX1
    if pipeline == FLUX1:
        embedded = checkpoint is None or checkpoint.guidance_distilled
        return prefix + (
            f"samples without one ({'its guidance scale is an input of the transformer' if embedded else 'its transformer takes no guidance'}); "
            "drop it, or turn on true CFG with --diffusion-true-cfg-scale > 1 "
            f"({_value(config, 'diffusion_true_cfg_scale')})"
        )
    if pipeline == KLEIN and checkpoint is not None and not checkpoint.step_distilled:
        return prefix + (
            "has one only with real CFG, --diffusion-guidance-scale > 1 "
            f"({_value(config, 'diffusion_guidance_scale')}); drop it or raise the guidance scale"
        )
    return prefix + "samples without one (it takes no guidance); drop it"


def config_errors(config: Any, checkpoint: FluxCheckpoint | None) -> list[str]:
    """Every FLUX rule ``config`` breaks for ``checkpoint``, one line each (see the module
    docstring)."""
    if checkpoint is not None and checkpoint.pipeline == FLUX2:
        # Refused before anything loads (Flux2Family refuses it too, once loaded).
        from miles_flux.flux2 import FLUX2_DEV_REFUSAL

        return [f"--hf-checkpoint {getattr(config, 'hf_checkpoint', '')}: {FLUX2_DEV_REFUSAL}"]
    checkpoint_path = str(getattr(config, "hf_checkpoint", "") or "")
    if checkpoint is None and checkpoint_path and Path(checkpoint_path).exists():
        return [
            f"--hf-checkpoint {checkpoint_path}: not a FLUX pipeline directory (its model_index.json names none of "
            f"{', '.join(PIPELINES)}), so the flux family cannot load it; drop --diffusion-model-family flux or point "
            "--hf-checkpoint at a FLUX checkpoint"
        ]
    errors = _size_errors(config, checkpoint)
    true_cfg = getattr(config, "diffusion_true_cfg_scale", None)
    if checkpoint is not None and checkpoint.pipeline == KLEIN and true_cfg is not None:
        errors.append(
            f"--diffusion-true-cfg-scale {true_cfg}: {checkpoint.name} has no true CFG, a FLUX.1 [dev] option "
            "(FluxPipeline's true_cfg_scale); the base model samples with real CFG through --diffusion-guidance-scale > 1, "
            "the step-distilled one without guidance"
        )
    guidance = getattr(config, "diffusion_guidance_scale", None)
    if checkpoint is not None and guidance is not None and guidance > 1 and _user_set(config, "diffusion_guidance_scale"):
        if checkpoint.pipeline == KLEIN and checkpoint.step_distilled:
            errors.append(
                f"--diffusion-guidance-scale {guidance}: {_model(checkpoint)} samples without guidance (its pipeline "
                "ignores the scale, is_distilled in model_index.json); leave it unset or at most 1, or use the klein base "
                "model for real CFG"
            )
        elif checkpoint.pipeline == FLUX1 and not checkpoint.guidance_distilled:
            errors.append(
                f"--diffusion-guidance-scale {guidance}: this FluxPipeline checkpoint's transformer takes no guidance "
                "(guidance_embeds is false, as in FLUX.1 [schnell]) and the pipeline ignores the scale; leave it unset "
                "or at most 1 (--diffusion-true-cfg-scale > 1 samples with true CFG)"
            )
    argument = cfg_parallel_argument(getattr(config, "sglang_args", ()) or ())
    if argument is not None and getattr(config, "rollout_engine", None) == "sglang" and not _has_unconditional_branch(config, checkpoint):
        errors.append(_cfg_parallel_error(argument, config, checkpoint))
    return errors


__all__ = ["CFG_PARALLEL_SIZES", "CFG_PARALLEL_SWITCH", "RELEASED_SIZE_MULTIPLE", "cfg_parallel_argument", "config_errors"]
