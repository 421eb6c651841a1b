"""The plan held against a measured peak (docs/benchmarks.md, "Memory plan against measured peaks").

:func:`reduced_checkpoint` writes a configuration-only copy of a checkpoint at reduced
depth (every block stack, text encoders' included, cut to a few layers; widths as
published), small enough to build with real, randomly initialised weights on this
machine; :func:`measured_peak` then runs what the plan counts for real (building the
pipeline and the run's trainer, one training micro-batch through its backward and the
optimizer step) under ``torch.profiler`` with ``profile_memory=True``, whose allocator
events give the bytes allocated at each moment, independently of the planner's own
counters (on a GPU the lane also reads ``torch.cuda.max_memory_allocated``).
The planner's ``train`` phase for the same folder and flags is the figure compared.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

DEPTH_KEYS = ("num_layers", "num_single_layers", "num_hidden_layers", "num_decoder_layers")
"""Configuration keys holding a block stack's depth (diffusers transformers; T5, CLIP and
the other transformers text encoders)."""


def _reduce(config: Any, depth: int) -> Any:
    if isinstance(config, dict):
        out = {}
        for key, value in config.items():
            if key in DEPTH_KEYS and isinstance(value, int) and value > depth:
                out[key] = depth
            elif key == "dual_attention_layers" and isinstance(value, list):
                out[key] = [index for index in value if index < depth]  # SD3.5: indices of blocks
            else:
                out[key] = _reduce(value, depth)
        return out
    return config


def reduced_checkpoint(source: str | Path, target: str | Path, depth: int = 2) -> Path:
    """A copy of the configuration-only checkpoint ``source`` at ``target`` whose every
    block stack has at most ``depth`` blocks (text encoders' nested configs included)."""
    source, target = Path(source), Path(target)
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.md"))
    for path in target.rglob("config.json"):
        path.write_text(json.dumps(_reduce(json.loads(path.read_text()), depth), indent=2))
    return target


def _materialised(pipeline: Any, device: str) -> Any:
    """``pipeline``'s meta components given real storage on ``device``, every value a small
    constant (``to_empty`` then ``fill_``: no initialiser's temporaries, and no NaN from
    uninitialised memory, which would send the SDE log-prob down its float64 fallback)."""
    with torch.no_grad():
        for component in pipeline.components.values():
            if isinstance(component, torch.nn.Module):
                component.to_empty(device=device)
                if hasattr(component, "tie_weights"):  # to_empty gives tied weights storages of their own
                    component.tie_weights()
                for tensor in (*component.parameters(), *component.buffers()):
                    if tensor.is_floating_point():
                        tensor.fill_(1e-3)
    return pipeline


def measured_peak(config: Any, *, device: str = "cpu") -> dict[str, int]:
    """Build ``config``'s pipeline on ``device`` from its checkpoint's configuration files
    (weights of a constant value), its trainer, then run a training micro-batch, the
    optimizer step and a second micro-batch, under the profiler: ``{"built": bytes,
    "peak": bytes}``, the total the allocator reported once the trainer was built, and the
    highest total from there on (everything allocated since the build's start); on CUDA
    also ``"max_memory_allocated"`` (``torch.cuda.max_memory_allocated`` over the same span)."""
    import gc

    from torch.profiler import ProfilerActivity, profile, record_function

    from miles_core.family import pipeline_class_for
    from miles_core.model_loading import family_class, torch_dtype
    from miles_core.planning.measure import count_micro_batch, plan_request, timestep_for
    from miles_core.planning.meta_pipeline import build_pipeline_from_configs
    from miles_core.training.run import build_trainer

    gc.collect()  # an earlier measurement's cycles are not this one's memory
    checkpoint = Path(config.hf_checkpoint)
    family_cls = family_class(config)
    dtype = torch_dtype(config.diffusion_forward_dtype)
    pipeline = build_pipeline_from_configs(
        checkpoint, pipeline_class_for(family_cls, checkpoint), dtype, family_cls.plan_components(checkpoint)
    )
    cuda = device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        allocated_before = torch.cuda.memory_allocated()
    with profile(activities=activities, profile_memory=True) as prof:
        family = family_cls(_materialised(pipeline, device), device=device, dtype=dtype)
        trainer = build_trainer(config, family)
        params = family.resolve_params(plan_request(config, int(config.micro_batch_size)))
        cond = family.plan_conditioning(params)
        t = timestep_for(family, next(iter(trainer.modules)), params)
        with record_function("miles_plan_steps"):
            # A micro-batch, the optimizer step (which creates its state), then a
            # micro-batch as every later step runs it: with the optimizer state resident.
            count_micro_batch(trainer, params, cond, t)
            trainer.masters.gather_gradients()
            trainer.optimizer.step()
            count_micro_batch(trainer, params, cond, t)
    totals = _allocator_totals(prof, device)
    if cuda:  # the caching allocator's own high-water mark, as the GPU lane reports it
        torch.cuda.synchronize()
        totals["max_memory_allocated"] = torch.cuda.max_memory_allocated() - allocated_before
    return totals


def _allocator_totals(prof: Any, device: str) -> dict[str, int]:
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        trace = Path(scratch) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    start = min(e["ts"] for e in events if e.get("name") == "miles_plan_steps")
    kind = 1 if device.startswith("cuda") else 0  # the trace's "Device Type": 0 CPU, 1 CUDA
    records = sorted(
        (e["ts"], e["args"]["Total Allocated"], e["args"]["Bytes"])
        for e in events
        if e.get("name") == "[memory]" and e["args"].get("Device Type") == kind
    )
    if not records:
        return {"built": 0, "peak": 0}
    # The totals are the allocator's, process-wide: what was allocated before the profile
    # started (and is still alive) is taken off.
    base = records[0][1] - records[0][2]
    before = [total - base for ts, total, _ in records if ts < start]
    built = before[-1] if before else 0
    return {"built": built, "peak": max([built, *(total - base for ts, total, _ in records if ts >= start)])}


__all__ = ["DEPTH_KEYS", "measured_peak", "reduced_checkpoint"]
