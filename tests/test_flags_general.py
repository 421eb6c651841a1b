"""What the general, cluster, optimizer, data, batching and evaluation flags do: values
that reach the optimizer, the learning-rate schedule, the micro-batches, the prompts and
the evaluation requests, checked against formulas and observable effects (a flag that
were ignored would fail its test). Runs are tiny (the SD3 test pipeline, 32x32, a few
denoising steps); most are rollout-only (``--debug-rollout-only``)."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
import torch

from miles_core.config.resolve import resolve_config, training_errors
from miles_core.errors import ConfigError, RunError
from miles_core.training.run import train
from tests.tiny_runs import tiny_run_args

SD35 = ["--hf-checkpoint", "stabilityai/stable-diffusion-3.5-medium"]


def resolve(*argv):
    return resolve_config(list(argv))


def errors_of(*argv):
    with pytest.raises(ConfigError) as caught:
        resolve(*argv)
    return caught.value.messages


def tiny_args(tiny_sd3, prompts, out):
    return tiny_run_args(tiny_sd3, prompts, out)


def run(args, engine_factory=None):
    path = asyncio.run(train(resolve_config(args), log=lambda line: None, engine_factory=engine_factory))
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


# -- cluster --------------------------------------------------------------------------------------


@pytest.mark.exercises("--actor-num-nodes", "--actor-num-gpus-per-node")
def test_nodes_times_gpus_per_node_is_the_train_world_size():
    c = resolve(*SD35, "--rollout-batch-size", "6", "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "3")
    assert (c.world_size, c.data_parallel_size) == (6, 6)
    # The global batch must divide by the data-parallel size the two flags give.
    assert errors_of(*SD35, "--rollout-batch-size", "3", "--actor-num-nodes", "2") == [
        "--global-batch-size 3 must be divisible by the data-parallel size 2"
    ]
    # Several ranks are Ray actors: without --use-ray, one line with the ways out.
    c = resolve(*SD35, "--rollout-batch-size", "2", "--diffusion-num-sde-steps", "2", "--actor-num-nodes", "2")
    assert training_errors(c) == [
        "--actor-num-nodes 2 x --actor-num-gpus-per-node 1 = world size 2: several training ranks run as Ray actors; "
        "add --use-ray (or --ray-address), or pass --actor-num-gpus-per-node 1 to train in one process"
    ]
    assert errors_of(*SD35, "--rollout-batch-size", "1", "--actor-num-nodes", "-1") == ["--actor-num-nodes -1: must be at least 1"]
    assert errors_of(*SD35, "--rollout-batch-size", "1", "--actor-num-gpus-per-node", "two") == [
        "--actor-num-gpus-per-node two: expected a positive integer or auto"
    ]
    assert errors_of(*SD35, "--rollout-batch-size", "1", "--actor-num-gpus-per-node", "0") == [
        "--actor-num-gpus-per-node 0: must be at least 1"
    ]


def test_zero_nodes_is_a_one_line_error():
    assert errors_of(*SD35, "--rollout-batch-size", "1", "--actor-num-nodes", "0") == ["--actor-num-nodes 0: must be at least 1"]


# -- training backend and optimizer ------------------------------------------------------------------


@pytest.mark.exercises("--train-backend", "--optimizer")
@pytest.mark.parametrize("flag, good, bad", [("--train-backend", "fsdp", "megatron"), ("--optimizer", "adam", "sgd")])
def test_single_valued_choices_refuse_other_values(flag, good, bad, capsys):
    assert resolve(*SD35, "--rollout-batch-size", "1", flag, good).get(flag[2:].replace("-", "_")) == good
    with pytest.raises(SystemExit) as caught:
        resolve(*SD35, "--rollout-batch-size", "1", flag, bad)
    assert caught.value.code == 2
    assert f"argument {flag}: invalid choice: '{bad}' (choose from '{good}')" in capsys.readouterr().err


class _OneLayerFamily:
    """Just enough of a model family for the trainer's optimizer: one trainable module."""

    def __init__(self) -> None:
        self.transformer = torch.nn.Linear(3, 1, bias=False)
        with torch.no_grad():
            self.transformer.weight.copy_(torch.tensor([[0.5, -1.0, 2.0]]))

    def components(self):
        return {"transformer": self.transformer}

    def trainable_parameters(self, component):
        return self.components()[component].named_parameters()


def _trainer(*flags):
    from miles_core.plugin_manager import get_host
    from miles_core.training.trainer import Trainer

    config = resolve(*SD35, "--rollout-batch-size", "1", *flags)
    host = get_host()
    trainer = Trainer(
        _OneLayerFamily(), config, host.registries.sde_backend.get("sde").load(), host.registries.loss.get("policy_loss").load()
    )
    (parameter,) = trainer.parameters
    return trainer, parameter


@pytest.mark.exercises("--optimizer", "--lr", "--adam-beta1", "--adam-beta2", "--adam-eps", "--weight-decay")
def test_two_optimizer_steps_follow_the_adamw_formula_with_the_flags():
    lr, beta1, beta2, eps, wd = 0.1, 0.5, 0.75, 0.3, 0.2
    trainer, parameter = _trainer(
        "--lr",
        str(lr),
        "--adam-beta1",
        str(beta1),
        "--adam-beta2",
        str(beta2),
        "--adam-eps",
        str(eps),
        "--weight-decay",
        str(wd),
        "--clip-grad",
        "0",
    )
    assert isinstance(trainer.optimizer, torch.optim.AdamW)
    grads = [torch.tensor([[0.3, -0.2, 0.1]]), torch.tensor([[-0.1, 0.4, 0.05]])]
    # AdamW by hand, in float64: decoupled decay, then the bias-corrected moments.
    p = parameter.detach().double().clone()
    m = torch.zeros_like(p)
    v = torch.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        p = p * (1 - lr * wd)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        p = p - lr * (m / (1 - beta1**t)) / ((v / (1 - beta2**t)).sqrt() + eps)
    for g in grads:
        trainer.optimizer.zero_grad()
        parameter.grad = g.clone()
        sums = {}
        trainer.finish_step(sums, skip=False)
        assert sums["lr"] == lr
    assert torch.allclose(parameter.detach().double(), p, rtol=0, atol=1e-6)
    assert trainer.optimizer_steps == 2


@pytest.mark.exercises("--clip-grad")
@pytest.mark.parametrize("clip, expected_norm", [("0.5", 0.5), (None, 1.0), ("0", 5.0)])
def test_clip_grad_caps_the_gradient_norm_and_zero_turns_it_off(clip, expected_norm):
    trainer, parameter = _trainer(*(["--clip-grad", clip] if clip is not None else []))
    parameter.grad = torch.tensor([[3.0, 4.0, 0.0]])  # norm 5
    sums = {}
    trainer.finish_step(sums, skip=False)
    assert sums["grad_norm"] == pytest.approx(5.0)  # the norm before clipping is reported
    assert float(parameter.grad.norm()) == pytest.approx(expected_norm, rel=1e-5)


# -- learning-rate schedule in a run ---------------------------------------------------------------------

LR, MIN, INIT = 1e-3, 1e-4, 1e-5


def _cosine(r):
    return MIN + 0.5 * (1 + math.cos(math.pi * r)) * (LR - MIN)


@pytest.mark.exercises(
    "--lr",
    "--min-lr",
    "--lr-warmup-init",
    "--lr-warmup-iters",
    "--lr-warmup-fraction",
    "--lr-decay-style",
    "--lr-decay-iters",
    "--lr-wsd-decay-iters",
    "--lr-wsd-decay-style",
    "--num-rollout",
    "--num-steps-per-rollout",
    "--global-batch-size",
    "--rollout-batch-size",
    "--n-samples-per-prompt",
)
@pytest.mark.parametrize(
    "flags, expected",
    [
        # Warmup over 1 step from the init, then linear decay to min-lr over the run's 4 steps.
        (
            ["--lr-decay-style", "linear", "--lr-warmup-iters", "1", "--lr-warmup-init", str(INIT)],
            [INIT, LR, MIN + (1 - 1 / 3) * (LR - MIN), MIN + (1 - 2 / 3) * (LR - MIN)],
        ),
        # Warmup 0.25 x 4 decay iterations = 1 step (from 0), then cosine over steps 1..4.
        (
            ["--lr-decay-style", "cosine", "--lr-warmup-fraction", "0.25", "--lr-decay-iters", "4"],
            [0.0, LR, _cosine(1 / 3), _cosine(2 / 3)],
        ),
        # Warmup-stable-decay: stable until the last 2 of 4 steps, then linear.
        (["--lr-decay-style", "wsd", "--lr-wsd-decay-iters", "2", "--lr-wsd-decay-style", "linear"], [LR, LR, LR, MIN + 0.5 * (LR - MIN)]),
        # The same with the default wsd decay style (exponential): 2 * 0.5**q - 1.
        (["--lr-decay-style", "wsd", "--lr-wsd-decay-iters", "2"], [LR, LR, LR, MIN + (2 * 0.5**0.5 - 1) * (LR - MIN)]),
    ],
    ids=["linear-warmup-iters", "cosine-warmup-fraction", "wsd-linear", "wsd-default"],
)
def test_the_lr_flags_set_each_optimizer_steps_rate(tiny_sd3, prompts, tmp_path, flags, expected):
    # 2 prompts x 4 samples = 8 per rollout; a global batch of 4 gives 2 optimizer steps per rollout.
    records = run(
        [
            *tiny_args(tiny_sd3, prompts, tmp_path / "run"),
            "--num-rollout",
            "2",
            "--global-batch-size",
            "4",
            "--use-lora",
            "--lora-rank",
            "4",
            "--lr",
            str(LR),
            "--min-lr",
            str(MIN),
            *flags,
        ]
    )
    assert [r["rollout_id"] for r in records] == [0, 1]
    assert [r["rollout/num_samples"] for r in records] == [8, 8]
    assert [len(r["train/loss_per_step"]) for r in records] == [2, 2]
    rates = [lr for r in records for lr in r["train/lr_per_step"]]
    assert rates == pytest.approx(expected, rel=1e-9, abs=1e-15)


@pytest.mark.exercises("--lr-warmup-iters", "--lr-warmup-fraction")
def test_warmup_iters_and_fraction_are_exclusive():
    (message,) = errors_of(*SD35, "--rollout-batch-size", "1", "--lr-warmup-iters", "2", "--lr-warmup-fraction", "0.1")
    assert message == "--lr-warmup-iters and --lr-warmup-fraction are mutually exclusive"


# -- micro-batches ------------------------------------------------------------------------------------------


def _pairs(num_samples, steps):
    from miles_core.family import Conditioning, GenerationParams
    from miles_core.training.pairs import TrainPair

    params = GenerationParams(height=32, width=32, num_inference_steps=4, guidance_scale=1.0)
    return [
        TrainPair(
            sample_index=s,
            step=k,
            x={"latents": torch.zeros(2)},
            x_next={"latents": torch.zeros(2)},
            timestep=torch.tensor(1.0),
            sigma=0.5,
            sigma_next=0.25,
            sigma_max=1.0,
            old_log_prob=0.0,
            advantage=0.0,
            cond=Conditioning({"c": torch.zeros(1, 1)}),
            params=params,
        )
        for s in range(num_samples)
        for k in steps
    ]


@pytest.mark.exercises("--micro-batch-size", "--micro-batch-size-sample", "--micro-batch-size-tstep", "--diffusion-train-iter-order")
def test_micro_batch_flags_cut_the_pairs():
    from miles_core.training.pairs import micro_batches

    pairs = _pairs(3, (0, 1))  # sample-major, steps ascending, as build_pairs makes them

    def cut(*flags):
        config = resolve(*SD35, "--rollout-batch-size", "1", *flags)
        return [[(p.sample_index, p.step) for p in batch] for batch in micro_batches(pairs, config)]

    assert cut() == [[(s, k)] for s in range(3) for k in (0, 1)]  # default: one pair per forward
    assert cut("--micro-batch-size", "4") == [[(0, 0), (0, 1), (1, 0), (1, 1)], [(2, 0), (2, 1)]]
    tile = ("--micro-batch-size-sample", "2", "--micro-batch-size-tstep", "1")
    # Tiles of 2 samples x 1 step; rows step by step.
    assert cut(*tile) == [[(0, 0), (1, 0)], [(0, 1), (1, 1)], [(2, 0)], [(2, 1)]]
    assert cut(*tile, "--diffusion-train-iter-order", "sample_major") == cut(*tile)
    assert cut(*tile, "--diffusion-train-iter-order", "timestep_major") == [[(0, 0), (1, 0)], [(2, 0)], [(0, 1), (1, 1)], [(2, 1)]]
    assert cut("--micro-batch-size-sample", "2", "--micro-batch-size-tstep", "2") == [[(0, 0), (1, 0), (0, 1), (1, 1)], [(2, 0), (2, 1)]]
    # The tile wins over a flat size given with it.
    assert cut(*tile, "--micro-batch-size", "4") == cut(*tile)


# -- how many rollouts, and from where ------------------------------------------------------------------


@pytest.mark.exercises("--num-rollout", "--num-epoch")
def test_rollout_count_from_num_rollout_or_num_epoch():
    from miles_core.training.run import number_of_rollouts

    base = (*SD35, "--rollout-batch-size", "2")
    assert number_of_rollouts(resolve(*base, "--num-rollout", "5"), 3) == 5
    assert number_of_rollouts(resolve(*base, "--num-epoch", "2"), 3) == 3  # ceil(2 x 3 prompts / 2 per rollout)
    assert number_of_rollouts(resolve(*base, "--num-epoch", "1"), 3) == 2  # ceil(1.5)
    both = resolve(*base, "--num-rollout", "5", "--num-epoch", "2")
    assert number_of_rollouts(both, 3) == 5
    assert "--num-epoch is ignored because --num-rollout is set (as in the reference)" in both.notes
    with pytest.raises(RunError, match=r"set --num-rollout \(rollouts to run\) or --num-epoch"):
        number_of_rollouts(resolve(*base), 3)


def _outputs(template, rollout_id):
    from miles_core.training.debug_data import load_rollout_data

    samples, _ = load_rollout_data(template, rollout_id)
    return samples


@pytest.mark.exercises("--start-rollout-id")
def test_start_rollout_id_is_the_first_rollout_run(tiny_sd3, prompts, tmp_path):
    def rollouts(name, *extra):
        template = str(tmp_path / name / "{}.msgpack")
        records = run(
            [
                *tiny_args(tiny_sd3, prompts, tmp_path / f"run-{name}"),
                "--num-rollout",
                "3",
                "--debug-rollout-only",
                "--save-debug-rollout-data",
                template,
                *extra,
            ]
        )
        return [r["rollout_id"] for r in records], template

    full_ids, full = rollouts("full")
    late_ids, late = rollouts("late", "--start-rollout-id", "2")
    assert full_ids == [0, 1, 2] and late_ids == [2]
    assert not (tmp_path / "late" / "0.msgpack").exists()
    # Rollout 2 is the same rollout either way: its prompts, seeds and samples.
    a, b = _outputs(full, 2), _outputs(late, 2)
    assert [(s.prompt, s.seed) for s in a] == [(s.prompt, s.seed) for s in b]
    assert all(torch.equal(x.pixels, y.pixels) for x, y in zip(a, b))
    assert [(s.prompt, s.seed) for s in _outputs(full, 0)] != [(s.prompt, s.seed) for s in b]  # control


# -- prompt data ------------------------------------------------------------------------------------------


async def metadata_score(args, samples):
    """A reward that reads each sample's metadata (for the --metadata-key test)."""
    return [float(s.metadata.get("score", 0.0)) for s in samples]


@pytest.mark.exercises("--prompt-data", "--input-key", "--metadata-key")
def test_prompt_and_metadata_keys_reach_the_rollout_samples(tiny_sd3, tmp_path):
    from miles_core.errors import PromptDataError

    data = tmp_path / "rows.jsonl"
    data.write_text(
        json.dumps({"caption": "a red cube", "input": "a blue ball", "info": {"score": 2.0}, "metadata": {"score": -1.0}}) + "\n"
    )

    def rollout(name, *extra):
        template = str(tmp_path / name / "{}.msgpack")
        args = tiny_args(tiny_sd3, data, tmp_path / f"run-{name}")
        args[args.index("--rm-type") : args.index("--rm-type") + 2] = ["--custom-rm-path", "tests.test_flags_general.metadata_score"]
        (record,) = run(
            [
                *args,
                "--rollout-batch-size",
                "1",
                "--num-rollout",
                "1",
                "--debug-rollout-only",
                "--save-debug-rollout-data",
                template,
                *extra,
            ]
        )
        return record, _outputs(template, 0)

    record, samples = rollout("keys", "--input-key", "caption", "--metadata-key", "info")
    assert {s.prompt for s in samples} == {"a red cube"} and {s.metadata["score"] for s in samples} == {2.0}
    assert record["rollout/reward/raw_mean"] == 2.0
    record, samples = rollout("defaults")
    assert {s.prompt for s in samples} == {"a blue ball"} and record["rollout/reward/raw_mean"] == -1.0
    # A key the rows lack is an error naming the file, the line and the flag.
    with pytest.raises(PromptDataError, match=r"rows.jsonl:1: no 'text' key \(set --input-key"):
        rollout("missing", "--input-key", "text")


# -- evaluation ---------------------------------------------------------------------------------------------


@pytest.mark.exercises("--eval-prompt-data", "--eval-input-key", "--n-samples-per-eval-prompt", "--diffusion-eval-num-steps")
def test_eval_flags_shape_the_evaluation_requests(tmp_path):
    from miles_core.rollout.evaluation import EVAL_SEED_OFFSET
    from miles_core.training.evaluation import Evaluator

    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text('{"caption": "a red cube", "input": "x"}\n{"caption": "a blue ball", "input": "y"}\n')
    second.write_text('{"caption": "a green tree", "input": "z"}\n')
    base = (
        *SD35,
        "--rollout-batch-size",
        "1",
        "--diffusion-num-steps",
        "6",
        "--rm-type",
        "brightness",
        "--eval-prompt-data",
        "cubes",
        str(first),
        "trees",
        str(second),
    )  # the evaluator builds its reward
    config = resolve(*base, "--eval-input-key", "caption", "--n-samples-per-eval-prompt", "3", "--diffusion-eval-num-steps", "2")
    evaluator = Evaluator(config, engine=None, scorer=None)
    assert {name: [r.prompt for r in rows] for name, rows in evaluator.datasets.items()} == {
        "cubes": ["a red cube", "a blue ball"],
        "trees": ["a green tree"],
    }
    requests = evaluator.requests(evaluator.datasets["cubes"])
    assert [r.num_outputs_per_prompt for r in requests] == [3, 3]
    assert [r.seed for r in requests] == [42 + EVAL_SEED_OFFSET, 42 + EVAL_SEED_OFFSET + 3]  # 3 seeds per prompt
    assert [r.num_inference_steps for r in requests] == [2, 2]
    assert not any(r.rollout for r in requests)
    # Unset: the prompt key is --input-key, one sample per prompt, the rollout's step count.
    plain = Evaluator(resolve(*base), engine=None, scorer=None)
    assert [r.prompt for r in plain.datasets["cubes"]] == ["x", "y"]
    assert [(r.num_outputs_per_prompt, r.num_inference_steps) for r in plain.requests(plain.datasets["cubes"])] == [(1, 6)] * 2


@pytest.mark.exercises("--eval-interval", "--skip-eval-before-train")
def test_eval_interval_and_skipping_the_first_evaluation(tiny_sd3, prompts, tmp_path):
    def evaluated(name, *extra):
        records = run(
            [
                *tiny_args(tiny_sd3, prompts, tmp_path / name),
                "--num-rollout",
                "3",
                "--debug-rollout-only",
                "--eval-prompt-data",
                "shapes",
                str(prompts),
                *extra,
            ]
        )
        grids = sorted(p.name for p in (tmp_path / name / "samples").glob("*.png"))  # the grids (samples/eval/: the archive)
        return ["eval/shapes/reward_mean" in r for r in records], grids

    # Every 2nd rollout and after the last; the evaluation before training lands in the first record.
    assert evaluated("every2", "--eval-interval", "2") == (
        [True, True, True],
        ["eval_shapes_00000_before.png", "eval_shapes_00002.png", "eval_shapes_00003.png", "eval_shapes_before_after.png"],
    )
    assert evaluated("skip", "--eval-interval", "2", "--skip-eval-before-train") == (
        [False, True, True],
        ["eval_shapes_00002.png", "eval_shapes_00003.png", "eval_shapes_before_after.png"],
    )


# -- SFT rows, seeding, determinism ---------------------------------------------------------------------------


def _sft_data(root):
    from PIL import Image

    (root / "images").mkdir(parents=True)
    rows = []
    for i, colour in enumerate([(220, 30, 30), (30, 30, 220)]):
        Image.new("RGB", (32, 32), colour).save(root / "images" / f"{i}.png")
        rows.append(json.dumps({"input": f"square {i}", "picture": f"images/{i}.png"}))
    (root / "sft.jsonl").write_text("\n".join(rows) + "\n")
    return root / "sft.jsonl"


@pytest.mark.exercises("--sft-image-key", "--seed")
def test_sft_image_key_and_seed(tiny_sd3, tmp_path):
    from miles_core.errors import PromptDataError

    data = _sft_data(tmp_path / "data")

    def sft(name, *extra):
        return run(
            [
                "--hf-checkpoint",
                str(tiny_sd3),
                "--diffusion-model-family",
                "sd3",
                "--prompt-data",
                str(data),
                "--loss-type",
                "sft_loss",
                "--rollout-batch-size",
                "2",
                "--micro-batch-size",
                "2",
                "--diffusion-num-steps",
                "4",
                "--diffusion-height",
                "32",
                "--diffusion-width",
                "32",
                "--lr",
                "1e-3",
                "--num-rollout",
                "1",
                "--output-dir",
                str(tmp_path / name),
                *extra,
            ]
        )[0]["train/loss"]

    with pytest.raises(PromptDataError, match=r"sft.jsonl:1: SFT rows need a string 'input' and a string 'image'"):
        sft("default-key")
    first = sft("a", "--sft-image-key", "picture", "--seed", "3")
    assert sft("b", "--sft-image-key", "picture", "--seed", "3") == first
    # The noise and the trained timesteps are drawn from --seed.
    assert sft("c", "--sft-image-key", "picture", "--seed", "4") != first


class _Stop(Exception):
    pass


@pytest.mark.exercises("--deterministic-mode", "--seed")
def test_deterministic_mode_and_seed_are_set_before_the_model_loads(tiny_sd3, prompts, tmp_path, monkeypatch):
    """The run seeds torch and turns on deterministic algorithms before it builds
    anything (stopped here where it would start the engine)."""

    def stop(config):
        raise _Stop(torch.initial_seed(), torch.are_deterministic_algorithms_enabled())

    before = torch.are_deterministic_algorithms_enabled()

    def state(*extra):
        with torch.random.fork_rng():
            try:
                run([*tiny_args(tiny_sd3, prompts, tmp_path / "run"), "--num-rollout", "1", *extra], engine_factory=stop)
            except _Stop as stopped:
                return stopped.args
            finally:
                torch.use_deterministic_algorithms(before)
        raise AssertionError("the run did not reach the engine")

    assert state("--seed", "77", "--deterministic-mode") == (77, True)
    assert state() == (1234, before)  # the defaults: --seed 1234, no deterministic mode


# -- forward dtype -------------------------------------------------------------------------------------------


@pytest.mark.exercises("--diffusion-forward-dtype")
def test_forward_dtype_is_the_models_dtype(tiny_sd3):
    from miles_core.engine.factory import create_engine
    from miles_core.model_loading import load_family as _load_family

    def dtypes(*extra):
        config = resolve("--hf-checkpoint", str(tiny_sd3), "--diffusion-model-family", "sd3", "--rollout-batch-size", "1", *extra)
        engine_family = create_engine(config).family  # RL: the embedded engine's modules
        trainer_family = _load_family(config)  # SFT and replays: the trainer loads the family itself
        return {(family.dtype, next(family.components()["transformer"].parameters()).dtype) for family in (engine_family, trainer_family)}

    assert dtypes("--diffusion-forward-dtype", "bf16") == {(torch.bfloat16, torch.bfloat16)}
    assert dtypes("--diffusion-forward-dtype", "fp16") == {(torch.float16, torch.float16)}
    assert dtypes() == {(torch.float32, torch.float32)}  # auto on a machine without GPUs
