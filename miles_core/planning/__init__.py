"""The memory planner: what a run will hold, per training rank and per engine, from its
configuration files alone (docs/design.md, "Planning memory").

:func:`plan_run` is ``miles-core plan``; :func:`check_memory_plan` is what ``train`` runs
after the configuration resolves and before any weight is read. Both build the run's
components on the meta device (:mod:`~miles_core.planning.meta_pipeline`), count one
training step and one rollout microgroup there (:mod:`~miles_core.planning.measure`) and
lay the counts out by phase (:mod:`~miles_core.planning.plan`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from miles_core.errors import ConfigError

GPU_DTYPE = "bf16"
"""What ``--diffusion-forward-dtype auto`` picks on a GPU."""


def plannable(config: Any) -> str | None:
    """Why ``config``'s run cannot be planned (None when it can): the planner reads a local
    checkpoint directory's configuration files and builds the family's own pipeline."""
    if config.model_backend_path:
        return "--model-backend-path loads the model with user code, which the planner cannot build without running it"
    if config.train_pipeline_config_path:
        return "--train-pipeline-config-path names a family class outside the registry"
    if config.get("sft_encoder_checkpoint"):
        return "--sft-encoder-checkpoint combines two checkpoints"
    if not Path(str(config.hf_checkpoint)).is_dir():
        return f"--hf-checkpoint {config.hf_checkpoint} is not a local directory (the planner reads its configuration files)"
    return None


def device_capacity(config: Any, *, training: bool) -> tuple[int, str, bool]:
    """``(bytes, what they are, on_host)``: the visible GPU's memory; else, for ``train``,
    the host's available memory (the run computes there), and for ``plan``
    ``--gpu-memory-gb``."""
    from miles_core.machine import visible_gpu_count

    if visible_gpu_count():
        import torch

        total = torch.cuda.get_device_properties(0).total_memory
        return total, f"GPU 0, {torch.cuda.get_device_name(0)}", False
    if training:
        import psutil

        return psutil.virtual_memory().available, "the host's available memory: no GPU is visible", True
    return int(config.gpu_memory_gb * (1 << 30)), f"--gpu-memory-gb {config.gpu_memory_gb:g}", False


def planned_dtype(config: Any, *, training: bool) -> Any:
    """The forward dtype the plan counts in: the run's; for ``plan`` on a machine without a
    GPU, ``auto`` is counted as on a GPU (bf16)."""
    import torch

    from miles_core.config.model import Source
    from miles_core.model_loading import torch_dtype

    name = config.diffusion_forward_dtype
    if not training and config.source("diffusion_forward_dtype") is Source.MACHINE:
        name = GPU_DTYPE
    return torch_dtype(name) if name in ("fp32", "bf16", "fp16") else torch.float32


def plan_run(config: Any, *, training: bool = False, configured_first: bool = False) -> Any:
    """The :class:`~miles_core.planning.plan.MemoryPlan` of ``config``'s run. A run the
    planner cannot build is a one-line :class:`~miles_core.errors.ConfigError`.
    ``training`` (train's check) or ``configured_first``: count the configured gradient
    checkpointing first, the other setting only when a fix is needed."""
    from miles_core.planning.measure import measure_run
    from miles_core.planning.plan import Setting, build_plan
    from miles_core.plugin_manager import get_host

    reason = plannable(config)
    if reason is not None:
        raise ConfigError(f"cannot plan memory: {reason}")
    dtype = planned_dtype(config, training=training)
    capacity, source, on_host = device_capacity(config, training=training)
    # torch steps AdamW over all tensors at once on a GPU, one tensor at a time on a CPU.
    # train's check counts the micro-batch as configured first, and the other setting only
    # when a fix is needed (half the count for a run that fits).
    first = (bool(config.gradient_checkpointing),) if training or configured_first else (False, True)
    measured = measure_run(config, dtype=dtype, optimizer_foreach=not on_host, checkpointing=first, for_fixes=False)
    spec = get_host().registries.model_family.get(config.model_family).spec
    options = {
        "sequence_parallel": spec.sequence_parallel_refusal is None,
        "precompute": not config.use_ray and config.rollout_engine == "embedded",
    }
    setting = Setting.from_config(config)
    plan = build_plan(measured, setting, capacity=capacity, capacity_source=source, on_host=on_host, fix_options=options)
    if not plan.fits:
        # A fix may need what was not counted yet: the other checkpointing setting, the
        # sampling at smaller microgroups, the VAE's tiled decode (slow at video sizes).
        measured = measure_run(config, dtype=dtype, optimizer_foreach=not on_host)
        plan = build_plan(measured, setting, capacity=capacity, capacity_source=source, on_host=on_host, fix_options=options)
    return plan


def check_memory_plan(config: Any) -> Any | None:
    """``train``'s check before any weight is read: the plan of ``config`` (None when the run
    cannot be planned or ``--skip-memory-plan`` is set); a plan that does not fit is a
    one-line :class:`~miles_core.errors.ConfigError` naming the largest term and the change
    that fixes it."""
    from miles_core.planning.plan import gib

    if config.skip_memory_plan or plannable(config) is not None:
        return None
    plan = plan_run(config, training=True)
    if plan.fits:
        return plan
    peak = plan.peak()
    engine = plan.engine_peak()
    if engine is not None and engine.nbytes > plan.capacity and peak.nbytes <= plan.capacity:
        peak = engine
    largest = peak.largest()
    fix = f"; {' '.join(plan.fix.flags)} brings it to {gib(plan.fix.peak)}" if plan.fix else "; no change the planner tries makes it fit"
    raise ConfigError(
        f"memory plan: the peak at {peak.name} is {gib(peak.nbytes)}, over {gib(plan.capacity)} ({plan.capacity_source}); "
        f"largest term: {largest.name} {gib(largest.nbytes)}{fix} (miles-core plan shows every term; --skip-memory-plan starts anyway)"
    )


__all__ = ["check_memory_plan", "device_capacity", "plan_run", "plannable", "planned_dtype"]
