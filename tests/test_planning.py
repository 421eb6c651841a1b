"""The memory planner (miles_core.planning, `miles-core plan`, train's check before loading).

The counts are exact by construction: the same micro-batch counted on the meta device and
with real tensors on the CPU gives the same bytes, and the trainer's own tensors equal the
memory audit of a real trainer after an optimizer step. Each comparison has a control
that changes what is counted and must change the count.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from miles_core.config.resolve import resolve_config
from miles_core.family import pipeline_class_for
from miles_core.memory import audit_memory
from miles_core.model_loading import family_class
from miles_core.planning import plan_run
from miles_core.planning.accuracy import measured_peak, reduced_checkpoint
from miles_core.planning.measure import Affine, Measurements, StepCount, block_runs, count_micro_batch, measure_run, plan_request
from miles_core.planning.meta_pipeline import build_pipeline_from_configs
from miles_core.planning.plan import GIB, Setting, build_plan, load_host_terms, rank_phases, rollout_term
from miles_core.planning.tensor_bytes import LiveBytes, SavedForBackward, fused_attention
from miles_core.training.run import build_trainer
from miles_sd3.family import SD3Family

REPO = Path(__file__).resolve().parents[1]
REAL = REPO / "plugins" / "miles-wan22" / "tests" / "data" / "real_checkpoints" / "Wan2.2-TI2V-5B-Diffusers"


def _args(checkpoint: Path, *extra: str) -> list[str]:
    return [
        "--hf-checkpoint",
        str(checkpoint),
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "4",
        "--rollout-microgroup-size",
        "2",
        "--micro-batch-size",
        "2",
        "--diffusion-num-steps",
        "4",
        "--diffusion-guidance-scale",
        "4.5",
        "--diffusion-height",
        "64",
        "--diffusion-width",
        "64",
        "--use-lora",
        "--lora-rank",
        "4",
        *extra,
    ]


def _step_on(device: str, checkpoint: Path, config, *, checkpointing: bool = False) -> tuple[int, int, int]:
    """One micro-batch of the run counted with its modules on ``device`` (meta: built from the
    configuration files; cpu: the real pipeline loaded with its weights)."""
    family_cls = family_class(config)
    if device == "meta":
        pipeline = build_pipeline_from_configs(checkpoint, pipeline_class_for(family_cls, checkpoint), torch.float32)
        family = family_cls(pipeline, device="meta", dtype=torch.float32)
    else:
        family = family_cls.from_pretrained(checkpoint, device="cpu", dtype=torch.float32)
    trainer = build_trainer(config, family)
    if checkpointing:
        for module in trainer.modules.values():
            module.enable_gradient_checkpointing()
    request_params = family.resolve_params(plan_request(config, int(config.micro_batch_size)))
    cond = family.plan_conditioning(request_params)
    count_micro_batch(trainer, request_params, cond, 500.0)  # fills the model's caches
    return count_micro_batch(trainer, request_params, cond, 500.0)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient-checkpointing"])
def test_a_micro_batch_counts_the_same_on_the_meta_device_and_on_the_cpu(tiny_sd3, checkpointing):
    config = resolve_config(_args(tiny_sd3))
    on_meta = _step_on("meta", tiny_sd3, config, checkpointing=checkpointing)
    on_cpu = _step_on("cpu", tiny_sd3, config, checkpointing=checkpointing)
    # The planner hands the timesteps over on the host (Wan 2.2 picks its expert from their
    # values, which the meta device does not hold); moving them to the meta device is the
    # one allocation a CPU run does not make: [micro-batch] fp32.
    assert on_meta[:2] == on_cpu[:2]
    assert 0 <= on_meta[2] - on_cpu[2] <= 2 * 4
    saved, retained, peak = on_cpu
    assert 0 < saved <= retained < peak
    # Control: one sample fewer per micro-batch must change every count.
    smaller = _step_on("meta", tiny_sd3, resolve_config(_args(tiny_sd3, "--micro-batch-size", "1")), checkpointing=checkpointing)
    assert all(a != b for a, b in zip(smaller, on_meta))


def test_gradient_checkpointing_holds_fewer_activations(tiny_sd3):
    config = resolve_config(_args(tiny_sd3))
    plain = _step_on("meta", tiny_sd3, config)
    checkpointed = _step_on("meta", tiny_sd3, config, checkpointing=True)
    assert checkpointed[1] < plain[1]


def test_saved_tensors_are_what_autograd_saves():
    """SavedForBackward against a computation whose saved tensors are known: a linear layer
    saves its input, ReLU its output; the weight is left out as a parameter."""
    layer = torch.nn.Linear(8, 16)
    x = torch.randn(4, 8, requires_grad=True)
    with SavedForBackward(exclude=list(layer.parameters())) as saved:
        y = torch.relu(layer(x))
    assert saved.nbytes == x.numel() * 4 + y.numel() * 4
    assert saved.count == 2
    # Control: without a gradient to compute, autograd saves nothing.
    with torch.no_grad(), SavedForBackward(exclude=list(layer.parameters())) as none:
        torch.relu(layer(x))
    assert none.nbytes == 0


def test_live_bytes_follow_allocations_and_frees():
    with LiveBytes() as live:
        a = torch.empty(1000, device="meta")
        b = torch.empty(500, device="meta")
        view = a[:10]  # a view allocates nothing
        del a
        assert live.current == 6000  # `view` keeps a's storage alive
        del view
        assert live.current == 2000
        del b
    assert (live.current, live.peak) == (0, 6000)


def test_fused_attention_saves_no_score_matrix():
    q = torch.zeros(1, 2, 64, 8, device="meta", requires_grad=True)
    with SavedForBackward() as math:
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    math_bytes = math.nbytes
    del out
    with fused_attention(), SavedForBackward() as fused:
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q)
    # query, key and value (one storage here), the output and the log-sum-exp, alive with `out`.
    assert out.shape == q.shape
    assert fused.nbytes == 2 * q.numel() * 4 + 2 * 64 * 4
    assert math_bytes >= 2 * 64 * 64 * 4  # the math path keeps [B, H, L, L] scores


def test_the_trainers_tensors_equal_the_memory_audit_of_a_real_trainer(tiny_sd3):
    config = resolve_config(_args(tiny_sd3, "--fsdp-master-dtype", "fp32"))
    measured = measure_run(config, dtype=torch.float32, optimizer_foreach=False)
    family = family_class(config).from_pretrained(tiny_sd3, device="cpu", dtype=torch.float32)
    transformer = family.pipeline.transformer
    loaded = sum(t.numel() * t.element_size() for t in (*transformer.parameters(), *transformer.buffers()))
    trainer = build_trainer(config, family)
    for master in trainer.masters.masters:
        master.grad = torch.zeros_like(master)
    trainer.optimizer.step()
    report = audit_memory(parameters=trainer.parameters, optimizers=[trainer.optimizer]).by_role()
    assert measured.train_state["trainable"] == report["parameters"] > 0
    assert measured.train_state["gradients"] == report["gradients"]
    assert measured.train_state["optimizer_state"] == report["optimizer_state"] > 0
    components = {c.name: c.nbytes for c in measured.components}
    assert components["transformer"] == loaded
    # Control: a larger LoRA rank is more trainable bytes.
    larger = measure_run(resolve_config(_args(tiny_sd3, "--lora-rank", "8")), dtype=torch.float32, optimizer_foreach=False)
    assert larger.train_state["trainable"] == 2 * measured.train_state["trainable"]


def _deeper(tiny_sd3: Path, out: Path, layers: int) -> Path:
    """The tiny SD3 configuration with ``layers`` transformer blocks (weightless)."""
    shutil.copytree(tiny_sd3, out)
    path = out / "transformer" / "config.json"
    config = json.loads(path.read_text())
    config["num_layers"] = layers
    path.write_text(json.dumps(config))
    return out


def test_counts_at_reduced_depth_extrapolate_exactly(tiny_sd3, tmp_path):
    checkpoint = _deeper(tiny_sd3, tmp_path / "deep", 7)
    config = resolve_config(_args(checkpoint))
    family_cls = family_class(config)
    pipeline = build_pipeline_from_configs(checkpoint, pipeline_class_for(family_cls, checkpoint), torch.float32)
    runs = block_runs(pipeline.transformer)
    # Block 0 has the dual attention, the last one projects no context: three runs.
    assert [run.length for run in runs] == [1, 5, 1]
    fast = measure_run(config, dtype=torch.float32)
    exact = measure_run(config, dtype=torch.float32, exact_depth=True)
    assert fast.step == exact.step and fast.sampling == exact.sampling
    # Control: one block fewer changes what is counted.
    shallower = measure_run(resolve_config(_args(_deeper(tiny_sd3, tmp_path / "shallow", 6))), dtype=torch.float32, checkpointing=(False,))
    assert shallower.step[False].retained < fast.step[False].retained


def _measurements(**overrides) -> Measurements:
    from miles_core.planning.measure import Component

    values = dict(
        checkpoint="ckpt",
        family="sd3",
        dtype="bf16",
        components=[
            Component("transformer", "T", 10**9, 8 * GIB, "bf16", "trained"),
            Component("text_encoder", "E", 10**9, 4 * GIB, "bf16", "encoder"),
            Component("vae", "V", 10**8, GIB // 4, "bf16", "vae"),
        ],
        height=512,
        width=512,
        num_frames=None,
        micro_batch=1,
        microgroup=8,
        cfg=True,
        train_state={"trainable": GIB // 8, "master_copies": GIB // 4, "gradients": GIB // 4, "optimizer_state": GIB // 2},
        step={False: StepCount(30 * GIB, 30 * GIB, 31 * GIB), True: StepCount(GIB, GIB, 2 * GIB)},
        largest_block=GIB // 4,
        largest_tensor=GIB // 16,
        sampling=Affine(GIB, GIB // 4),  # 3 GiB at the microgroup of 8
        decode={False: Affine(2 * GIB, 0)},
        n_samples_per_prompt=16,
        trajectory_bytes=10**7,
        samples_per_rollout=16,
        optimizer_peak=GIB // 2,
    )
    values.update(overrides)
    return Measurements(**values)


SETTING = Setting(
    world=1, sequence_parallel=1, gradient_checkpointing=False, precompute_prompt_embeddings=False, embedded_engine=True, microgroup=8
)


def _phase(phases, name):
    return next(p for p in phases if p.name == name)


def test_the_train_phase_adds_up_its_terms():
    m = _measurements()
    train = _phase(rank_phases(m, SETTING), "train")
    weights = 8 * GIB + 4 * GIB + GIB // 4
    state = GIB // 8 + GIB // 4 + GIB // 2
    assert train.nbytes == weights + state + GIB // 4 + 31 * GIB
    assert train.largest().name == "micro-batch forward+backward"
    rollout = _phase(rank_phases(m, SETTING), "rollout")
    assert rollout.nbytes == weights + state + 3 * GIB


def test_fsdp_divides_the_trained_component_and_its_state():
    m = _measurements()
    one = _phase(rank_phases(m, SETTING), "train")
    two = _phase(rank_phases(m, Setting(2, 1, False, False, True)), "train")
    weights = {t.name: t.nbytes for t in two.terms}
    assert weights["transformer weights"] == 4 * GIB
    assert weights["text_encoder weights"] == 4 * GIB  # frozen components stay whole
    assert weights["optimizer state"] == GIB // 4
    assert weights["FSDP all-gather"] == 2 * (GIB // 4)
    assert two.nbytes < one.nbytes
    # Loading: each rank receives its shard of the trained transformer from rank 0, one
    # full tensor at a time; the frozen components load whole. One rank loads it all.
    load = _phase(rank_phases(m, Setting(2, 1, False, False, True)), "load")
    assert {t.name: t.nbytes for t in load.terms} == {
        "transformer weights": 4 * GIB,
        "text_encoder weights": 4 * GIB,
        "vae weights": GIB // 4,
        "tensor in flight": GIB // 16,
    }
    assert _phase(rank_phases(m, SETTING), "load").nbytes == 8 * GIB + 4 * GIB + GIB // 4
    # Rank 0 holds the trained weights on the host while the ranks load.
    assert [(t.name, t.nbytes) for t in load_host_terms(m, Setting(2, 1, False, False, True))] == [("rank 0's trained weights", 8 * GIB)]
    assert load_host_terms(m, SETTING) == []


def test_the_smallest_fix_is_named():
    m = _measurements()
    plan = build_plan(
        m, SETTING, capacity=40 * GIB, capacity_source="test", on_host=False, fix_options={"sequence_parallel": True, "precompute": True}
    )
    assert not plan.fits
    assert plan.fix is not None and plan.fix.flags == ("--gradient-checkpointing",)
    assert plan.fix.peak <= 40 * GIB
    # Tighter: checkpointing alone is not enough, dropping the text encoder is.
    tight = build_plan(
        m, SETTING, capacity=13 * GIB, capacity_source="test", on_host=False, fix_options={"sequence_parallel": True, "precompute": True}
    )
    assert tight.fix is not None and tight.fix.flags == ("--gradient-checkpointing", "--precompute-prompt-embeddings")
    # Nothing fits 1 GiB: no fix, and the plan says so.
    hopeless = build_plan(
        m, SETTING, capacity=GIB, capacity_source="test", on_host=False, fix_options={"sequence_parallel": True, "precompute": True}
    )
    assert hopeless.fix is None and not hopeless.fits


def test_a_rollout_bound_plan_is_fixed_on_the_rollout_side():
    # Training fits with checkpointing; the sampling forward of 8 outputs (1 + 8 x 4 GiB)
    # and the decode (2 + 6 GiB per output untiled, 3 GiB tiled) do not.
    m = _measurements(sampling=Affine(GIB, 4 * GIB), decode={False: Affine(2 * GIB, 6 * GIB), True: Affine(3 * GIB, 0)})
    setting = replace(SETTING, gradient_checkpointing=True)
    resident = 8 * GIB + 4 * GIB + GIB // 4 + GIB // 8 + GIB // 4 + GIB // 2
    rollout = _phase(rank_phases(m, setting), "rollout")
    assert rollout.nbytes == resident + 33 * GIB and rollout.largest().name == "sampling forward"
    options = {"sequence_parallel": False, "precompute": False}
    plan = build_plan(m, setting, capacity=resident + 13 * GIB, capacity_source="test", on_host=False, fix_options=options)
    # The largest microgroup dividing the 16 samples per prompt whose forward fits: 2
    # (9 GiB); the untiled decode of one output (8 GiB) fits too.
    assert plan.fix is not None and plan.fix.flags == ("--rollout-microgroup-size 2",)
    assert rollout_term(m, replace(setting, microgroup=2)).nbytes == 9 * GIB
    # Tighter: the decode is then the peak, and only tiling brings it down.
    tight = build_plan(m, setting, capacity=resident + 7 * GIB, capacity_source="test", on_host=False, fix_options=options)
    assert tight.fix is not None and tight.fix.flags == ("--rollout-microgroup-size 1", "--vae-tiling")
    tiled = rollout_term(m, replace(setting, microgroup=1, vae_tiling=True))
    assert (tiled.name, tiled.nbytes) == ("sampling forward", 5 * GIB)
    # --vae-decode-batch-size 4: one decode call takes 4 outputs (26 GiB), a microgroup of 2 only 2.
    chunked = replace(m, decode_batch_size=4)
    assert rollout_term(chunked, setting).nbytes == 33 * GIB
    assert rollout_term(chunked, replace(setting, microgroup=2)).nbytes == 14 * GIB


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    """``miles-core ARGS`` in this process: ``(exit status, stdout, stderr)``."""
    from miles_core.cli.main import main

    capsys.readouterr()
    status = main(list(args))
    out = capsys.readouterr()
    return status, out.out, out.err


@pytest.mark.exercises("--gpu-memory-gb")
def test_plan_command_prints_a_plan_and_json(tiny_sd3, capsys):
    status, text, err = _cli(capsys, "plan", *_args(tiny_sd3))
    assert status == 0, err
    assert "peak:" in text and ": fits" in text
    status, out, _ = _cli(capsys, "plan", *_args(tiny_sd3), "--json")
    data = json.loads(out)
    assert data["fits"] is True
    assert data["peak"]["bytes"] == max(p["bytes"] for p in data["training_rank"])
    assert set(data["activations"]) == {"with_gradient_checkpointing", "without_gradient_checkpointing"}
    status, small, _ = _cli(capsys, "plan", *_args(tiny_sd3), "--gpu-memory-gb", "0.00001")
    assert status == 1 and "does NOT fit" in small


def test_plan_needs_a_local_checkpoint(capsys):
    status, _, err = _cli(capsys, "plan", "--hf-checkpoint", "stabilityai/stable-diffusion-3.5-medium", "--rollout-batch-size", "1")
    assert status == 2
    assert err.strip().splitlines()[-1] == (
        "miles-core plan: error: cannot plan memory: --hf-checkpoint stabilityai/stable-diffusion-3.5-medium is not a local "
        "directory (the planner reads its configuration files)"
    )


@pytest.mark.exercises("--skip-memory-plan")
def test_train_refuses_a_run_that_cannot_fit_before_loading(tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"input": "a cat"}\n')
    # Wan 2.2 TI2V-5B in fp32 on this CPU: its weights alone are over 40 GiB.
    args = ["--hf-checkpoint", str(REAL), "--prompt-data", str(prompts), "--rollout-batch-size", "1", "--num-rollout", "1"]
    args += ["--diffusion-num-steps", "4", "--diffusion-num-sde-steps", "2", "--output-dir", str(tmp_path / "run")]
    args += ["--diffusion-height", "32", "--diffusion-width", "32", "--diffusion-output-num-frames", "5"]
    status, _, err = _cli(capsys, "train", *args)
    assert status == 2
    errors = [line for line in err.splitlines() if "error" in line]
    assert len(errors) == 1 and "memory plan: the peak at " in errors[0] and "largest term: " in errors[0], err
    assert "(the host's available memory: no GPU is visible)" in errors[0]
    assert not (tmp_path / "run").exists()
    # With the check skipped, the configuration-only folder stops at its missing weights.
    status, _, err = _cli(capsys, "train", *args, "--skip-memory-plan")
    assert status == 2
    assert "component text_encoder has a configuration but no weights" in err.strip().splitlines()[-1], err


def test_plan_of_a_real_configuration_counts_its_components():
    config = resolve_config(
        ["--hf-checkpoint", str(REAL), "--rollout-batch-size", "1", "--diffusion-num-steps", "4", "--diffusion-height", "32"]
        + ["--diffusion-width", "32", "--diffusion-output-num-frames", "5"]
    )
    plan = plan_run(config)
    components = {c.name: c for c in plan.measurements.components}
    assert components["transformer"].parameters == 4_999_787_712
    # bf16, but for the modules diffusers' from_pretrained keeps in fp32 (Wan's norms and
    # time embedding): a few MB more than 2 bytes a parameter.
    assert components["transformer"].dtype == "bf16+fp32"
    assert 2 * 4_999_787_712 < components["transformer"].nbytes < 2.01 * 4_999_787_712
    assert components["text_encoder"].role == "encoder" and components["vae"].role == "vae"


SD35_LARGE = REPO / "plugins" / "miles-sd3" / "tests" / "data" / "real_checkpoints" / "stable-diffusion-3.5-large"


def test_a_split_the_heads_cannot_share_is_a_configuration_error(capsys):
    args = ["--hf-checkpoint", str(SD35_LARGE), "--rollout-batch-size", "1", "--diffusion-num-steps", "4"]
    args += ["--use-ray", "--actor-num-gpus-per-node", "4", "--sequence-parallel-size", "4"]
    status, _, err = _cli(capsys, "plan", *args)
    assert status == 2
    assert err.strip().splitlines()[-1] == (
        "miles-core plan: error: --sequence-parallel-size 4 --ulysses-degree 4: Ulysses gives each rank a share of the "
        "attention heads, and component transformer has 38; use a Ulysses degree that divides 38"
    )


@pytest.mark.parametrize(("side", "fits"), [(48, False), (64, True)], ids=["9-tokens", "16-tokens"])
def test_a_split_the_tokens_cannot_share_is_a_configuration_error(tiny_sd3, capsys, side, fits):
    args = _args(tiny_sd3, "--use-ray", "--actor-num-gpus-per-node", "2", "--sequence-parallel-size", "2")
    args += ["--diffusion-height", str(side), "--diffusion-width", str(side)]
    status, _, err = _cli(capsys, "plan", *args)
    if fits:  # the control: 64x64 is 4x4 patches of the 8x8 latent, 16 tokens for 2 ranks
        assert status == 0, err
        return
    assert status == 2
    last = err.strip().splitlines()[-1]
    assert last.startswith("miles-core plan: error: --sequence-parallel-size 2: ") and "has 9 tokens along dimension 1" in last, err


SD35_MEDIUM = REPO / "plugins" / "miles-sd3" / "tests" / "data" / "real_checkpoints" / "stable-diffusion-3.5-medium"


def test_the_plan_matches_the_peak_the_profiler_measures(tmp_path):
    """The plan's train phase against torch.profiler's allocator totals of the same run done
    for real on this CPU: SD3.5-Medium at its published widths, one block of each stack,
    64x64 (16 image tokens; the text is T5's 256 and CLIP's 77), weights built, trainer,
    micro-batch, optimizer step, micro-batch."""
    checkpoint = reduced_checkpoint(SD35_MEDIUM, tmp_path / "sd35-medium-depth-1", depth=1)

    def config(micro_batch: int):
        args = ["--hf-checkpoint", str(checkpoint), "--rollout-batch-size", "1", "--diffusion-num-steps", "4"]
        args += ["--diffusion-num-sde-steps", "2", "--use-lora", "--diffusion-guidance-scale", "1", "--micro-batch-size", str(micro_batch)]
        return resolve_config([*args, "--diffusion-height", "64", "--diffusion-width", "64"])

    measured = measured_peak(config(2))
    planned = _phase(plan_run(config(2), training=True).rank, "train")
    # The whole phase, and the part on top of what the build leaves (weights, adapters,
    # master copies): optimizer state, gradients, the step; each within 15%.
    static = sum(t.nbytes for t in planned.terms if t.name.endswith(" weights") or t.name in ("trainable", "master copies"))
    assert abs(planned.nbytes / measured["peak"] - 1) < 0.15
    assert abs((planned.nbytes - static) / (measured["peak"] - measured["built"]) - 1) < 0.15
    # Control: the plan of one sample per micro-batch is visibly short of the measured two.
    smaller = _phase(plan_run(config(1), training=True).rank, "train")
    assert (smaller.nbytes - static) / (measured["peak"] - measured["built"]) < 0.85


def test_ranks_on_the_host_add_up():
    """Without a GPU every training rank computes on this host: its memory holds each
    rank's share (and the rollout's samples once)."""
    m = _measurements()
    one = build_plan(
        m, SETTING, capacity=1000 * GIB, capacity_source="host", on_host=True, fix_options={"sequence_parallel": False, "precompute": False}
    )
    two = build_plan(
        m,
        Setting(2, 1, False, False, True),
        capacity=1000 * GIB,
        capacity_source="host",
        on_host=True,
        fix_options={"sequence_parallel": False, "precompute": False},
    )
    samples = m.trajectory_bytes * m.samples_per_rollout
    per_rank = _phase(rank_phases(m, Setting(2, 1, False, False, True)), "train").nbytes
    assert two.peak().nbytes == 2 * per_rank + samples
    assert one.peak().nbytes == _phase(rank_phases(m, SETTING), "train").nbytes + samples
    # Control: on a GPU a rank's plan is its own.
    gpu = build_plan(m, Setting(2, 1, False, False, True), capacity=1000 * GIB, capacity_source="gpu", on_host=False, fix_options={})
    assert gpu.peak().nbytes == per_rank


def test_an_sft_run_plans_its_prompt_cache_on_the_host_at_its_bound(tiny_sd3, tmp_path):
    from miles_core import family_checks
    from miles_core.training.trainer import SFT_PROMPT_CACHE_BYTES, SFT_PROMPT_CACHE_ENTRIES

    args = family_checks.tiny_sft_args(tiny_sd3, tmp_path, ["a red cube", "a blue ball"], size=32)
    plan = plan_run(resolve_config(args), configured_first=True)
    # The family's real encoding of one prompt, counted on the CPU: the cache holds at most
    # SFT_PROMPT_CACHE_ENTRIES of them (the tiny encodings stay far below the byte bound).
    family = SD3Family.from_pretrained(tiny_sd3)
    params = family.resolve_params(plan_request(resolve_config(args), 1))
    cond = family.encode("a red cube", None, params)
    per_prompt = sum(t.untyped_storage().nbytes() for t in [*cond.positive.values(), *(cond.negative or {}).values()])
    (term,) = plan.host
    assert (term.name, term.nbytes) == ("SFT prompt cache", min(SFT_PROMPT_CACHE_BYTES, SFT_PROMPT_CACHE_ENTRIES * per_prompt))
    # Control: the RL run of the same checkpoint holds a rollout's samples instead.
    assert [t.name for t in plan_run(resolve_config(_args(tiny_sd3)), configured_first=True).host] == ["rollout samples"]
