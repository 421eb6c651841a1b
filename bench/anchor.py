"""The minimal-loop anchor: ``miles-core train`` against the Flow-GRPO loop a user would
write by hand, on the same tiny SD3 pipeline and configuration, interleaved in one run,
at 1 and 2 threads (and miles-core at its default thread setting).

The minimal loop (``--minimal-loop``, this file; no miles-core import anywhere in it) is
diffusers' ``StableDiffusion3Pipeline`` taken apart: its ``encode_prompt``, its
scheduler's ``set_timesteps`` (the checkpoint's shift; ``mu`` computed as the pipeline
does when the scheduler shifts dynamically), the transformer called directly in a
denoising loop whose first ``steps - 1`` steps are Flow-GRPO SDE steps with their
Gaussian log-probability and whose last step is an Euler step, the VAE decode, the JPEG
compressibility reward via Pillow, group-normalised advantages, the PPO-style clipped
loss over every SDE step, PEFT LoRA, AdamW and one optimizer step per rollout.

Where it is set equal to miles-core (the values are miles-core's defaults, read from
``miles_core/sde.py``, ``miles_core/losses.py``, ``miles_core/training/advantages.py``,
the miles-sd3 and miles-rewards plugins and the flag table; ``RUN`` below holds the
few set on both sides):

- SDE step (``--diffusion-sde-type sde``, ``--diffusion-noise-level 0.7``): ``s = η·sqrt(σ/(1−σ̃))``
  with ``σ̃ = σ_1`` where ``σ = 1``; ``μ = x·(1 + s²/(2σ)·dt) + v·(1 + s²(1−σ)/(2σ))·dt``;
  ``std = s·sqrt(−dt)``; log-prob the mean over the latent's elements of
  ``−(x'−μ)²/(2std²) − log std − log sqrt(2π)``, in fp32. SDE steps 0..steps-2.
- Loss (``--loss-type policy_loss``): ``A = clamp(adv, ±5)`` (``--diffusion-adv-clip-max``),
  ``r = exp(logp − logp_old)``, ``mean(max(−A·r, −A·clamp(r, 1 ± 1e-4)))``
  (``--diffusion-clip-range``), averaged over every (sample, SDE step) pair; KL off
  (``--diffusion-kl-beta 0``).
- Advantages (GRPO): per prompt group ``(r − mean) / (std + 1e-4)``, the unbiased std.
- Reward (``jpeg_compressibility``): ``round(x·255)`` clamped to uint8, JPEG at quality
  95, ``−size_kB / 500`` (1 kB = 1000 bytes).
- LoRA: rank 16 (set on both sides), alpha 64, ``init_lora_weights="gaussian"``, the
  sd3 plugin's joint-attention targets. AdamW: lr 1e-6, betas (0.9, 0.999), eps 1e-8,
  weight decay 0; gradient norm clipped to 1.0. fp32 on the CPU.
- Batches: each prompt group's 8 samples are denoised in one transformer call per step
  (miles-core: ``--rollout-microgroup-size 8``), and training recomputes each SDE step of
  a group in one call of the same 8 rows (miles-core: ``--micro-batch-size-sample 8
  --micro-batch-size-tstep 1``), so a recomputed log-prob goes through the same kernels
  on the same shapes as the sampled one.

Where they cannot be equal: the random draws (initial noise, SDE noise, LoRA init) come
from different generators, so the two loops train on different samples of the same
distribution; miles-core draws each output's noise from its own generator, the minimal
loop one batch at a time. miles-core scores rewards in worker threads while the rest of
the rollout generates; the minimal loop scores after generating.

The checks (the bench exits 1 with a one-line message when one fails):

- Each loop agrees with itself: at the first optimizer step, before any weight changes,
  the log-ratio (recomputed log-prob minus the sampled one) is exactly 0 for every pair
  (the minimal loop's own; miles-core's ``train/log_prob_max_abs_diff`` and
  ``train/log_prob_abs_diff_step_*`` of its first rollout). Control: ``--control
  weights`` nudges one LoRA weight of the minimal loop before its first recompute.
- The loops compute the same thing: the minimal loop dumps its first rollout's first SDE
  transition (x, v, x', σ, σ', σ_1, its log-prob) and that pair's loss inputs and output
  (advantages, old and new log-prob, loss); this process recomputes the log-prob with
  miles-core's built-in ``sde`` backend (``miles_core.sde.FlowSdeBackend``) and the loss
  with ``miles_core.losses.policy_loss``, at miles-core's defaults from its flag table,
  and the loss once more off the first step (ratios across the clip range, advantages
  past the clamp) against the minimal loop's own loss function. The same float32
  element-wise operations in the same order on the same tensors, and the same reduction
  over the same shapes: they must agree exactly. Control: ``--control sde`` gives the
  minimal loop's SDE step a σ̃ 1e-4 (relative) off, which its self-check cannot see.

Rounds of [minimal@1, miles@1, minimal@2, miles@2, miles@default], each a process of its
own running ``--rollouts`` rollouts (threads are set before torch loads): the minimal
loop at ``torch.set_num_threads(N)`` with ``OMP_NUM_THREADS=N``; miles-core at
``--cpu-threads N`` with ``OMP_NUM_THREADS=N``, and at its default (no flag, no
``OMP_NUM_THREADS``). Per process the median seconds per rollout over rollouts 3..N,
then the median over rounds.

Usage: python bench/anchor.py [--rollouts 20] [--rounds 2] [--threads 1,2]
       [--max-sequence-length 256] [--smoke] [--control weights|sde]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PHASES = ("rollout", "reward", "train", "step")
RUN = {"prompts": 2, "samples": 8, "steps": 8, "lora_rank": 16}
"""Set on both sides: prompts per rollout, samples per prompt, denoising steps (all but
the last are SDE steps), LoRA rank."""
SD3_T5_LENGTH = 256
"""StableDiffusion3Pipeline's default ``max_sequence_length`` (and miles-core's for SD3)."""

# miles-core's defaults, written out for the minimal loop (see the docstring).
NOISE_LEVEL = 0.7
CLIP_RANGE = 1e-4
ADV_CLIP_MAX = 5.0
ADV_EPS = 1e-4
LR = 1e-6
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8
CLIP_GRAD = 1.0
LORA_ALPHA = 64
LORA_TARGETS = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
)
JPEG_QUALITY = 95
SEED = 1234


# ------------------------------------------------------------------------ the minimal loop
def sde_mean_std(x: Any, v: Any, sigma: float, sigma_next: float, sigma_max: float) -> tuple[Any, Any]:
    """Flow-GRPO's SDE step: the mean and std of x' given x and the velocity v (fp32).
    ``sigma_max`` is σ̃ at σ = 1 (the ``sde`` control passes a wrong one)."""
    import torch

    x, v = x.float(), v.float()
    # One sigma per sample, shaped [B, 1, ..., 1], as Flow-GRPO's own step takes them.
    rows = (x.shape[0],) + (1,) * (x.ndim - 1)
    sig = torch.full(rows, sigma, dtype=torch.float32)
    sig_next = torch.full(rows, sigma_next, dtype=torch.float32)
    dt = sig_next - sig
    # At σ = 1 the ratio σ/(1−σ) is infinite: Flow-GRPO puts σ_1 in the denominator.
    sig_tilde = torch.full(rows, sigma_max if sigma == 1 else sigma, dtype=torch.float32)
    s = NOISE_LEVEL * torch.sqrt(sig / (1 - sig_tilde))
    mean = x * (1 + s**2 / (2 * sig) * dt) + v * (1 + s**2 * (1 - sig) / (2 * sig)) * dt
    return mean, s * torch.sqrt(-dt)


def gaussian_log_prob(x_next: Any, mean: Any, std: Any) -> Any:
    """Per-sample log N(x_next; mean, std²), averaged over the latent's elements."""
    import torch

    per_elem = -((x_next.detach() - mean) ** 2) / (2 * std**2) - torch.log(std) - math.log(math.sqrt(2 * math.pi))
    return per_elem.mean(dim=tuple(range(1, per_elem.ndim)))


def clipped_loss(advantages: Any, log_prob: Any, old_log_prob: Any) -> Any:
    """Flow-GRPO's PPO-style clipped loss of one (group, SDE step), its samples' mean."""
    import torch

    adv = torch.clamp(advantages, -ADV_CLIP_MAX, ADV_CLIP_MAX)
    ratio = torch.exp(log_prob - old_log_prob)
    return torch.mean(torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - CLIP_RANGE, 1 + CLIP_RANGE)))


def jpeg_compressibility(images: Any) -> list[float]:
    """-(JPEG size in kB at quality 95) / 500 of each [3, H, W] image in [0, 1]."""
    import io

    import numpy as np
    from PIL import Image

    scores = []
    for image in images:
        pixels = np.clip(np.round(image.double().numpy() * 255.0), 0, 255).astype(np.uint8).transpose(1, 2, 0)
        buffer = io.BytesIO()
        Image.fromarray(np.ascontiguousarray(pixels)).save(buffer, format="JPEG", quality=JPEG_QUALITY)
        scores.append(-buffer.tell() / 1000.0 / 500.0)
    return scores


def minimal_loop(args: argparse.Namespace) -> None:
    """Run ``args.rollouts`` rollouts of the minimal loop; one JSON line per rollout on stdout."""
    import torch

    torch.set_num_threads(args.threads)
    from diffusers import StableDiffusion3Pipeline
    from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(SEED)
    pipe = StableDiffusion3Pipeline.from_pretrained(args.pipeline)
    for module in (pipe.transformer, pipe.vae, pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3):
        module.requires_grad_(False)
    lora = LoraConfig(r=RUN["lora_rank"], lora_alpha=LORA_ALPHA, init_lora_weights="gaussian", target_modules=list(LORA_TARGETS))
    transformer = get_peft_model(pipe.transformer, lora)
    params = [p for p in transformer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=0.0)

    scheduler, vae = pipe.scheduler, pipe.vae
    height = width = pipe.default_sample_size * pipe.vae_scale_factor
    latent_shape = (pipe.transformer.config.in_channels, height // pipe.vae_scale_factor, width // pipe.vae_scale_factor)
    shift: dict[str, float] = {}
    if scheduler.config.get("use_dynamic_shifting", False):
        patch = pipe.transformer.config.patch_size
        shift["mu"] = calculate_shift(
            (latent_shape[1] // patch) * (latent_shape[2] // patch),
            scheduler.config.get("base_image_seq_len", 256),
            scheduler.config.get("max_image_seq_len", 4096),
            scheduler.config.get("base_shift", 0.5),
            scheduler.config.get("max_shift", 1.16),
        )
    scheduler.set_timesteps(args.steps, **shift)
    timesteps, sigmas = scheduler.timesteps.float(), scheduler.sigmas.float().tolist()
    sigma_max = sigmas[1]
    # The ``sde`` control: the loop's own σ̃ is off by 1e-4 (relative) while the dump
    # reports the right one, the kind of slip only the comparison with miles-core sees.
    loop_sigma_max = sigma_max * (1 + 1e-4) if args.control == "sde" else sigma_max
    sde_steps = range(args.steps - 1)  # the last step (to σ = 0) is an Euler step
    prompts = [json.loads(line)["input"] for line in Path(args.prompts).read_text(encoding="utf-8").splitlines() if line]
    generator = torch.Generator().manual_seed(SEED)
    n = args.samples

    for rollout in range(args.rollouts):
        began = time.perf_counter()
        groups = []
        with torch.no_grad():
            for j in range(args.prompt_groups):
                prompt = prompts[(rollout * args.prompt_groups + j) % len(prompts)]
                embeds, _, pooled, _ = pipe.encode_prompt(
                    prompt=prompt,
                    prompt_2=None,
                    prompt_3=None,
                    device="cpu",
                    num_images_per_prompt=1,
                    do_classifier_free_guidance=False,
                    max_sequence_length=args.max_sequence_length,
                )
                embeds, pooled = embeds.expand(n, -1, -1), pooled.expand(n, -1)
                x = torch.randn((n, *latent_shape), generator=generator)
                pairs = []
                for k in range(args.steps):
                    t = timesteps[k].expand(n)
                    v = transformer(
                        hidden_states=x, timestep=t, encoder_hidden_states=embeds, pooled_projections=pooled, return_dict=False
                    )[0]
                    if k in sde_steps:
                        mean, std = sde_mean_std(x, v, sigmas[k], sigmas[k + 1], loop_sigma_max)
                        x_next = mean + std * torch.randn(x.shape, generator=generator)
                        pairs.append((k, x, x_next, gaussian_log_prob(x_next, mean, std)))
                        if rollout == 0 and j == 0 and k == 0:
                            first = {"x": x, "v": v, "x_next": x_next, "log_prob": pairs[-1][3]}
                            first_sigmas = {"sigma": sigmas[k], "sigma_next": sigmas[k + 1], "sigma_max": sigma_max}
                    else:
                        x_next = x + (sigmas[k + 1] - sigmas[k]) * v.float()
                    x = x_next
                image = vae.decode(x / vae.config.scaling_factor + vae.config.shift_factor, return_dict=False)[0]
                groups.append({"embeds": embeds, "pooled": pooled, "pairs": pairs, "images": (image * 0.5 + 0.5).clamp(0, 1)})
        generated = time.perf_counter()
        if args.control == "weights" and rollout == 0:
            # The check's control: the weights the first recompute sees are not those it sampled with.
            with torch.no_grad():
                next(p for name, p in transformer.named_parameters() if "lora_B" in name).view(-1)[0] += 1e-2
        for group in groups:
            rewards = torch.tensor(jpeg_compressibility(group["images"]))
            group["advantages"] = (rewards - rewards.mean()) / (rewards.std() + ADV_EPS)
        scored = time.perf_counter()

        optimizer.zero_grad(set_to_none=True)
        total = sum(len(group["pairs"]) * n for group in groups)
        log_ratio = 0.0
        for group in groups:
            for k, x, x_next, old_log_prob in group["pairs"]:
                t = timesteps[k].expand(n)
                v = transformer(
                    hidden_states=x,
                    timestep=t,
                    encoder_hidden_states=group["embeds"],
                    pooled_projections=group["pooled"],
                    return_dict=False,
                )[0]
                mean, std = sde_mean_std(x, v, sigmas[k], sigmas[k + 1], loop_sigma_max)
                log_prob = gaussian_log_prob(x_next, mean, std)
                log_ratio = max(log_ratio, float((log_prob.detach() - old_log_prob).abs().max()))
                loss = clipped_loss(group["advantages"], log_prob, old_log_prob)
                if rollout == 0 and group is groups[0] and k == 0:
                    first |= {
                        "advantages": group["advantages"],
                        "old_log_prob": old_log_prob,
                        "new_log_prob": log_prob.detach(),
                        "loss": loss.detach(),
                    }
                (loss * (n / total)).backward()  # the step's loss: the mean over all pairs
        torch.nn.utils.clip_grad_norm_(params, CLIP_GRAD)
        optimizer.step()
        trained = time.perf_counter()
        if rollout == 0:
            dump_first_transition(Path(args.dump), first, first_sigmas)
        record = {
            "rollout": rollout,
            "rollout_time": generated - began,
            "reward_time": scored - generated,
            "train_time": trained - scored,
            "step_time": trained - began,
            "log_ratio_max_abs": log_ratio,
        }
        print(json.dumps(record), flush=True)


def dump_first_transition(path: Path, tensors: dict[str, Any], sigmas: dict[str, float]) -> None:
    """Write the first rollout's first SDE transition and its loss inputs and output
    (safetensors; the sigmas, Python floats, as exact ``repr`` strings in its metadata)."""
    from safetensors.torch import save_file

    save_file({k: v.detach().clone() for k, v in tensors.items()}, str(path), metadata={k: repr(v) for k, v in sigmas.items()})


# --------------------------------------------------------------------- the miles-core side
def cross_check(path: Path) -> dict[str, float]:
    """Recompute the minimal loop's dumped first transition with miles-core: its
    log-prob with the built-in ``sde`` backend at miles-core's default noise level, its
    loss with ``policy_loss`` at miles-core's default clip range, advantage clamp and KL
    coefficient. At the first step the ratio is 1 and no advantage reaches the clamp, so
    the loss is also compared (``loss_clipped``) on the same pair with the log-prob moved
    across the clip range and advantages spread past the clamp, the minimal loop's
    :func:`clipped_loss` against ``policy_loss``. Each pair of sides runs the same float32
    element-wise operations, in the same order, on the same tensors, with the same
    reduction over the same shapes (the minimal loop's sigmas are per sample and the
    backend expands its std per sample, so even ``log(std)``, whose CPU kernel may take
    another code path for another length, sees the same [B, 1, ..., 1] tensor on both
    sides), so they must agree bit for bit: the max |difference| of each (0.0 when they
    do)."""
    from types import SimpleNamespace

    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    from miles_core.config.reference_flags import FLAGS
    from miles_core.losses import policy_loss
    from miles_core.sde import FlowSdeBackend

    t = load_file(str(path))
    with safe_open(str(path), framework="pt") as f:
        sigmas = {k: float(v) for k, v in f.metadata().items()}
    default = {flag.name: flag.default for flag in FLAGS}
    backend = FlowSdeBackend(noise_level=default["--diffusion-noise-level"])
    step = backend.log_prob(t["x_next"], t["x"], t["v"], sigmas["sigma"], sigmas["sigma_next"], sigma_max=sigmas["sigma_max"], step_index=0)
    config = SimpleNamespace(
        diffusion_clip_range=default["--diffusion-clip-range"],
        diffusion_adv_clip_max=default["--diffusion-adv-clip-max"],
        diffusion_kl_beta=default["--diffusion-kl-beta"],
    )
    batch = {"log_prob": t["new_log_prob"], "old_log_prob": t["old_log_prob"], "advantages": t["advantages"]}
    loss, _ = policy_loss(batch, config)
    n = t["new_log_prob"].shape[0]
    moved = t["new_log_prob"] + torch.linspace(-3 * CLIP_RANGE, 3 * CLIP_RANGE, n)
    scaled = torch.linspace(-2 * ADV_CLIP_MAX, 2 * ADV_CLIP_MAX, n)
    clipped, _ = policy_loss({"log_prob": moved, "old_log_prob": t["old_log_prob"], "advantages": scaled}, config)
    return {
        "log_prob": float((step.log_prob - t["log_prob"]).abs().max()),
        "loss": float((loss - t["loss"]).abs()),
        "loss_clipped": float((clipped - clipped_loss(scaled, moved, t["old_log_prob"])).abs()),
    }


async def with_sequence_length(engine: Any, request: Any) -> Any:
    """``--custom-generate-function-path`` for a T5 length other than SD3's default:
    ``miles-core train`` has no flag for it, the request's ``extra_sampling_params`` does."""
    from dataclasses import replace

    extra = {**request.extra_sampling_params, "max_sequence_length": int(os.environ["ANCHOR_MAX_SEQUENCE_LENGTH"])}
    return await engine.generate(replace(request, extra_sampling_params=extra))


def miles_command(args: argparse.Namespace, pipeline: Path, prompts: Path, out: Path, threads: int | None) -> list[str]:
    flags = [
        "--hf-checkpoint",
        str(pipeline),
        "--diffusion-model-family",
        "sd3",
        "--prompt-data",
        str(prompts),
        "--rollout-batch-size",
        str(args.prompt_groups),
        "--n-samples-per-prompt",
        str(args.samples),
        "--rollout-microgroup-size",
        str(args.samples),
        "--diffusion-num-steps",
        str(args.steps),
        "--diffusion-num-sde-steps",
        str(args.steps - 1),
        "--diffusion-guidance-scale",
        "1",
        "--use-lora",
        "--lora-rank",
        str(RUN["lora_rank"]),
        "--num-steps-per-rollout",
        "1",
        "--micro-batch-size-sample",
        str(args.samples),
        "--micro-batch-size-tstep",
        "1",
        "--rm-type",
        "jpeg_compressibility",
        "--num-rollout",
        str(args.rollouts),
        "--seed",
        str(SEED),
        "--output-dir",
        str(out),
    ]
    if threads is not None:
        flags += ["--cpu-threads", str(threads)]
    if args.max_sequence_length != SD3_T5_LENGTH:
        flags += ["--custom-generate-function-path", "anchor.with_sequence_length"]
    script = Path(sys.executable).with_name("miles-core")
    launcher = [str(script)] if script.exists() else [sys.executable, "-m", "miles_core.cli.main"]
    return [*launcher, "train", *flags]


def child_env(threads: int | None, max_sequence_length: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    env["ANCHOR_MAX_SEQUENCE_LENGTH"] = str(max_sequence_length)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).resolve().parent), env.get("PYTHONPATH")) if p)
    return env


def run(command: list[str], env: dict[str, str], what: str) -> str:
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.stderr.write(result.stdout[-3000:] + result.stderr[-3000:])
        sys.exit(f"anchor.py: {what} failed (exit {result.returncode})")
    return result.stdout


def run_minimal(
    args: argparse.Namespace, pipeline: Path, prompts: Path, workdir: Path, threads: int
) -> tuple[list[dict[str, float]], float, dict[str, float]]:
    dump = Path(tempfile.mkdtemp(prefix="minimal-", dir=workdir)) / "first-transition.safetensors"
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--minimal-loop",
        "--pipeline",
        str(pipeline),
        "--prompts",
        str(prompts),
        "--threads",
        str(threads),
        "--dump",
        str(dump),
        *_shared_flags(args),
        *(["--control", args.control] if args.control else []),
    ]
    out = run(command, child_env(threads, args.max_sequence_length), f"the minimal loop at {threads} thread(s)")
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    times = [{phase: r[f"{phase}_time"] for phase in PHASES} for r in records]
    return times, records[0]["log_ratio_max_abs"], cross_check(dump)


def run_miles(
    args: argparse.Namespace, pipeline: Path, prompts: Path, workdir: Path, threads: int | None
) -> tuple[list[dict[str, float]], float]:
    out = Path(tempfile.mkdtemp(prefix="miles-", dir=workdir))
    label = f"--cpu-threads {threads}" if threads else "default threads"
    run(
        miles_command(args, pipeline, prompts, out / "run", threads),
        child_env(threads, args.max_sequence_length),
        f"miles-core train ({label})",
    )
    records = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text(encoding="utf-8").splitlines() if line]
    first = records[0]
    drift = [first["train/log_prob_max_abs_diff"], *(v for k, v in first.items() if k.startswith("train/log_prob_abs_diff_step_"))]
    times = [{phase: r[f"perf/{phase}_time"] for phase in PHASES} for r in records]
    return times, max(drift)


def _shared_flags(args: argparse.Namespace) -> list[str]:
    return [
        "--rollouts",
        str(args.rollouts),
        "--steps",
        str(args.steps),
        "--prompt-groups",
        str(args.prompt_groups),
        "--samples",
        str(args.samples),
        "--max-sequence-length",
        str(args.max_sequence_length),
    ]


def steady(times: list[dict[str, float]]) -> dict[str, float]:
    """Median seconds per rollout over rollouts 3..N (the first two warm up)."""
    kept = times[2:] or times[-1:]
    return {phase: statistics.median(t[phase] for t in kept) for phase in PHASES}


def over_rounds(rounds: list[dict[str, float]]) -> dict[str, float]:
    return {phase: statistics.median(r[phase] for r in rounds) for phase in PHASES}


def row(label: str, t: dict[str, float]) -> str:
    return f"| {label} | " + " | ".join(f"{t[phase]:.3f}" for phase in PHASES) + " |"


def ratio_row(label: str, num: dict[str, float], den: dict[str, float]) -> str:
    return f"| {label} | " + " | ".join(f"{num[p] / den[p]:.2f}x" if den[p] > 0 else "-" for p in PHASES) + " |"


def measure(
    args: argparse.Namespace, threads: list[int], workdir: Path
) -> tuple[dict[tuple[str, int | None], list[dict[str, float]]], dict[str, list[float]], list[dict[str, float]]]:
    """Build the tiny pipeline and run the interleaved rounds: per (loop, threads) the
    steady-state times of each round, per loop the first-step log-ratio of each process,
    and per minimal-loop process its first transition's differences from miles-core."""
    from miles_sd3.family import SD3Family

    # In this process (it may import miles-core; only the minimal loop's may not): what
    # ``miles-core make-tiny sd3`` writes, without a process of its own.
    pipeline = SD3Family.build_tiny_pipeline(workdir / "tiny-sd3")
    prompts = workdir / "prompts.jsonl"
    colors, things = (
        ("red", "blue", "green", "yellow", "purple", "orange", "white", "black"),
        ("cube", "ball", "cone", "tree", "house", "cat", "boat", "cup"),
    )
    prompts.write_text("".join(json.dumps({"input": f"a {c} {t}"}) + "\n" for c in colors for t in things), encoding="utf-8")

    measured: dict[tuple[str, int | None], list[dict[str, float]]] = {}
    drift: dict[str, list[float]] = {"minimal loop": [], "miles-core": []}
    agreement: list[dict[str, float]] = []
    for _ in range(args.rounds):
        for n in threads:
            times, first, differences = run_minimal(args, pipeline, prompts, workdir, n)
            measured.setdefault(("minimal", n), []).append(steady(times))
            drift["minimal loop"].append(first)
            agreement.append(differences)
            times, first = run_miles(args, pipeline, prompts, workdir, n)
            measured.setdefault(("miles", n), []).append(steady(times))
            drift["miles-core"].append(first)
        if not args.smoke:
            times, first = run_miles(args, pipeline, prompts, workdir, None)
            measured.setdefault(("miles", None), []).append(steady(times))
            drift["miles-core"].append(first)
    return measured, drift, agreement


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=20, help="rollouts per process (medians over rollouts 3..N)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the interleaved processes")
    parser.add_argument("--threads", default="1,2", help="comma list of thread counts")
    parser.add_argument("--max-sequence-length", type=int, default=SD3_T5_LENGTH, help="T5 prompt length (SD3's default 256)")
    parser.add_argument("--steps", type=int, default=RUN["steps"], help="denoising steps; all but the last are SDE steps")
    parser.add_argument(
        "--smoke", action="store_true", help="one tiny round: 3 rollouts, 1 round, 1 thread, 2 steps, no default-threads run"
    )
    parser.add_argument(
        "--control",
        choices=("weights", "sde"),
        help="the checks' controls, each must make the bench exit 1: 'weights' nudges one LoRA weight of the minimal loop "
        "between its first sampling and recompute (the log-ratio check); 'sde' gives the minimal loop's SDE step a "
        "sigma-tilde 1e-4 off (the comparison with miles-core)",
    )
    parser.add_argument("--minimal-loop", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--pipeline", help=argparse.SUPPRESS)
    parser.add_argument("--prompts", help=argparse.SUPPRESS)
    parser.add_argument("--dump", help=argparse.SUPPRESS)
    parser.add_argument("--prompt-groups", type=int, default=RUN["prompts"], help=argparse.SUPPRESS)
    parser.add_argument("--samples", type=int, default=RUN["samples"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.minimal_loop:
        args.threads = int(args.threads)
        minimal_loop(args)
        return
    if args.smoke:
        args.rollouts, args.rounds, args.threads, args.steps = 3, 1, "1", 2
    threads = [int(t) for t in args.threads.split(",")]
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the last step is never an SDE step)")

    with tempfile.TemporaryDirectory(prefix="bench-anchor-") as tmp:
        measured, drift, agreement = measure(args, threads, Path(tmp))

    print(
        f"tiny SD3 (miles-core make-tiny sd3), T5 length {args.max_sequence_length}; {args.prompt_groups} prompts x "
        f"{args.samples} samples, {args.steps} steps ({args.steps - 1} SDE), no CFG, LoRA rank {RUN['lora_rank']}, one optimizer "
        f"step per rollout, jpeg_compressibility; median seconds per rollout over rollouts 3..{args.rollouts}, median of "
        f"{args.rounds} round(s) (interleaved)"
    )
    print(
        "first-step log-ratio, max |recomputed - sampled| log-prob: "
        + "; ".join(f"{loop} {max(values)!r} ({len(values)} runs)" for loop, values in drift.items())
    )
    worst = {key: max(d[key] for d in agreement) for key in agreement[0]}
    print(
        "minimal loop vs miles-core on its first SDE transition (miles_core.sde sde backend, miles_core.losses.policy_loss), "
        f"max |difference|: log-prob {worst['log_prob']!r}, loss {worst['loss']!r}, loss off the first step "
        f"{worst['loss_clipped']!r} ({len(agreement)} runs; must be exactly 0)"
    )
    result = {key: over_rounds(rounds) for key, rounds in measured.items()}
    for n in threads:
        print(f"\n{n} thread(s)")
        print("| loop | " + " | ".join(f"{p} s" for p in PHASES) + " |")
        print("|---|" + "---|" * len(PHASES))
        print(row(f"minimal loop, torch.set_num_threads({n})", result[("minimal", n)]))
        print(row(f"miles-core train --cpu-threads {n}", result[("miles", n)]))
        print(ratio_row("ratio miles-core / minimal", result[("miles", n)], result[("minimal", n)]))
    if ("miles", None) in result:
        print("\nmiles-core at its default thread setting (no --cpu-threads, no OMP_NUM_THREADS)")
        print("| loop | " + " | ".join(f"{p} s" for p in PHASES) + " |")
        print("|---|" + "---|" * len(PHASES))
        print(row("miles-core train (default)", result[("miles", None)]))
        base = min(threads)
        print(ratio_row(f"ratio miles-core default / --cpu-threads {base}", result[("miles", None)], result[("miles", base)]))
    bad = {loop: max(values) for loop, values in drift.items() if any(v != 0.0 for v in values)}
    if bad:
        sys.exit("anchor.py: the first-step log-ratio is not exactly 0: " + ", ".join(f"{loop} {value!r}" for loop, value in bad.items()))
    if any(d[key] != 0.0 for d in agreement for key in d):
        sys.exit(
            "anchor.py: the minimal loop's first SDE transition differs from miles-core's: "
            f"log-prob {worst['log_prob']!r}, loss {worst['loss']!r}, loss off the first step {worst['loss_clipped']!r}"
        )


if __name__ == "__main__":
    main()
