"""A run that learns, and the reward-hacking guard that watches it: Flow-GRPO with LoRA
raises a weight-free reward on the SD3 demo pipeline (its VAE decodes something
meaningful; see docs/guide.md), judged by a paired evaluation (the same held-out prompts
and seeds before and after training), and on the way its held-out samples collapse toward
one pattern, which the guard reports (docs/guide.md, "Reward-hacking guard").

Both run the demo's own configuration: the flags scripts/demo.sh trains with, read from the
file it reads them from (examples/demo/train.flags: 40 rollouts, colorfulness, an
evaluation every 10 rollouts, 4 held-out prompts x 4 samples, the default seeds
``--seed 1234 --rollout-seed 42``), once learning and once with
``--debug-skip-optimizer-step`` (the control: frozen weights, so every evaluation is the
first one again, bit for bit). The module runs each once and every test reads them.

How the margins were chosen, measured on 2026-12-02 with exactly this configuration at one
torch thread (the same numbers on every run on one machine: the seeds fix every sample),
at the default seeds and, for how much they vary, at three other seed pairs
(``--seed N --rollout-seed N``):

- paired gain after 10, 20, 30, 40 rollouts: 0.031, 0.092, 0.092, 0.131 (default seeds);
  0.020, 0.068, 0.117, 0.127 (0); 0.035, 0.108, 0.136, 0.166 (1); final 0.169 (2) and
  0.168 (3), the initial held-out mean about 0.34. The test requires a final gain above
  0.03, under a quarter of the smallest final gain; the frozen run's gain is exactly 0.
- held-out diversity drift (in spreads of the first evaluation, docs/guide.md
  "Reward-hacking guard"): -1.83, -3.00, -3.78, -3.72 (default seeds); -0.55, -1.71,
  -2.04, -2.70 (0); -1.29, -1.62, -2.06, -1.99 (1); -1.33, -1.40, -1.67, -1.86 (2);
  -1.68, -2.00, -2.06, -2.27 (3). With the default threshold 2.0 the demo's run raises
  the diversity alarm at rollouts 20, 30 and 40, 1.7 spreads past the threshold at 40:
  the test requires it at the last evaluation. Diversity (the mean pairwise distance)
  fell by 24 to 31% by rollout 40 on every seed pair; the threshold stays 2.0 (seed pair
  2 stays under it, and a lower default would fire sooner on runs that do not collapse;
  the guide says how to tune it). The frozen run's image-statistic drifts are exactly 0
  and its KL exactly 0 (after its first rollout; none is measured before), so it raises
  no alarm whatever the threshold.
"""

import asyncio
import json
import math
from pathlib import Path

import pytest

from miles_core.config.resolve import resolve_config
from miles_core.training.run import train

ROOT = Path(__file__).resolve().parents[1]
DEMO_FLAGS = ROOT / "examples" / "demo" / "train.flags"


def demo_flags() -> list[str]:
    """scripts/demo.sh's training flags, read as the script reads them (words split on
    whitespace, ``#`` comments), paths made absolute."""
    words = [word for line in DEMO_FLAGS.read_text().splitlines() for word in line.split("#")[0].split()]
    return [str(ROOT / word) if word.startswith("examples/") else word for word in words]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from miles_sd3.demo import build_demo_pipeline

    return build_demo_pipeline(tmp_path_factory.mktemp("demo") / "sd3-demo", seed=0)


def demo_run(root, out, *extra):
    """scripts/demo.sh's training run, its seeds included; its records and the lines it logged."""
    config = resolve_config(["--hf-checkpoint", str(root), *demo_flags(), "--output-dir", str(out), *extra])
    lines: list[str] = []
    path = asyncio.run(train(config, log=lines.append))
    records = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    return records, lines, path


@pytest.fixture(scope="module")
def learning(demo, tmp_path_factory):
    return demo_run(demo, tmp_path_factory.mktemp("learn") / "run")


@pytest.fixture(scope="module")
def frozen(demo, tmp_path_factory):
    """The control every learning test shares: the demo's run with frozen weights, as long
    as the algorithms' runs (its evaluations at rollouts 0, 9 and 11)."""
    return demo_run(
        demo, tmp_path_factory.mktemp("frozen") / "run", "--debug-skip-optimizer-step", "--num-rollout", str(ALGORITHM_ROLLOUTS)
    )


def evaluations(records):
    return [r for r in records if "guard/alarms" in r]


def test_grpo_raises_colorfulness_on_held_out_prompts(learning):
    last = learning[0][-1]
    print(f"paired gain {last['eval/held-out/paired_gain']:.4f} (std {last['eval/held-out/paired_gain_std']:.4f})")
    assert last["eval/held-out/paired_gain"] > 0.03


def test_without_learning_there_is_no_gain(frozen):
    last = frozen[0][-1]
    assert last["eval/held-out/paired_gain"] == 0.0


def test_the_guard_raises_the_diversity_alarm_as_the_samples_collapse(learning):
    records, lines, path = learning
    checked = evaluations(records)
    assert [r["rollout_id"] for r in checked] == [0, 9, 19, 29, 39]  # before training, then every 10 rollouts
    drifts = [r["guard/held-out/diversity/drift"] for r in checked]
    print("diversity drift per evaluation", [round(d, 2) for d in drifts])
    raised = [r for r in checked if r["guard/held-out/diversity/alarm"] > 0]
    assert raised and raised[-1] is checked[-1], f"no diversity alarm at rollout 40; drifts {drifts}"
    alarms = [json.loads(line) for line in (path / "guard.jsonl").read_text().splitlines()]
    diversity = [a for a in alarms if a["statistic"] == "diversity"]
    assert [a["rollout_id"] for a in diversity] == [r["rollout_id"] for r in raised]
    for alarm, record in zip(diversity, raised):
        assert alarm["eval_set"] == "held-out" and alarm["drift"] == record["guard/held-out/diversity/drift"]
        assert alarm["drift"] < -alarm["threshold"] and alarm["value"] < alarm["baseline"]
        assert alarm["trained_rollouts"] == record["rollout_id"] + 1
        assert alarm["message"] in lines  # the console line
        assert alarm["message"].startswith("guard: alarm: held-out diversity fell ")
    assert sum(r["guard/alarms"] for r in checked) == len(alarms)


def test_a_frozen_run_raises_no_alarm(frozen):
    records, lines, path = frozen
    checked = evaluations(records)
    assert [r["rollout_id"] for r in checked] == [0, 9, ALGORITHM_ROLLOUTS - 1]
    assert all(r["guard/alarms"] == 0.0 for r in checked)
    assert not (path / "guard.jsonl").exists() and not [line for line in lines if line.startswith("guard: alarm")]
    # Frozen weights: every evaluation is the first one again, bit for bit, and the policy is the reference.
    for record in checked:
        for key, value in record.items():
            if key.startswith("guard/held-out/") and key.endswith("/drift") and "reward_gap" not in key:
                assert value == 0.0, key
        # The KL: not measured before a rollout trained (no transitions yet), then exactly 0.
        assert record.get("guard/kl") == (None if record["rollout_id"] == 0 else 0.0)


def test_the_demo_script_trains_with_the_shared_flags():
    script = (ROOT / "scripts" / "demo.sh").read_text()
    assert "examples/demo/train.flags" in script and '"${train_flags[@]}"' in script
    assert "--rm-type" not in script and "--num-rollout" not in script  # no second copy of a flag to drift apart


# -- the algorithms of miles-algorithms --------------------------------------------------------

ALGORITHM_ROLLOUTS = 12
"""The issue's budget: at most 12 rollouts per algorithm; each run evaluates at rollout 0 and
at its last (11), which the frozen control evaluates too."""

ALGORITHMS = {
    "grpo_guard": ("--loss-type", "grpo_guard"),
    # A 5-step window over the 7 SDE-able steps, moved by one step every 6 rollouts.
    "mixgrpo": ("--diffusion-step-strategy-path", "mixgrpo", "--diffusion-num-sde-steps", "5", "--mixgrpo-shift-interval", "6"),
    "flow_dpo": ("--loss-type", "flow_dpo"),
}
"""Each algorithm's flags on top of the demo's (LoRA, so DPO's reference is the base model)."""

_runs: dict[str, tuple] = {}


def algorithm_run(demo, tmp_path_factory, name):
    """The demo's run with ``ALGORITHMS[name]``, 12 rollouts, run once per module."""
    if name not in _runs:
        out = tmp_path_factory.mktemp(name) / "run"
        _runs[name] = demo_run(demo, out, *ALGORITHMS[name], "--num-rollout", str(ALGORITHM_ROLLOUTS), "--eval-interval", "12")
    return _runs[name]


def lower_bound(record, z=2.0):
    """The paired gain minus ``z`` standard errors: the per-sample gains' spread over the
    ``sqrt`` of the held-out samples (4 prompts x 4 samples). Samples of one prompt share its
    content, so this treats them as more independent than they are; ``z`` = 2 leaves room."""
    samples = 4 * len((ROOT / "examples" / "prompts" / "demo-eval.jsonl").read_text().splitlines())
    return record["eval/held-out/paired_gain"] - z * record["eval/held-out/paired_gain_std"] / math.sqrt(samples)


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_each_algorithm_raises_colorfulness_beyond_the_frozen_control(demo, tmp_path_factory, frozen, name):
    """A paired gain above zero with a confidence bound after 12 rollouts, where the frozen
    control (the same evaluation, weights never updated) gains exactly 0."""
    records, lines, _ = algorithm_run(demo, tmp_path_factory, name)
    last = records[-1]
    assert last["rollout_id"] == ALGORITHM_ROLLOUTS - 1 and "eval/held-out/paired_gain" in last
    control = frozen[0][-1]
    assert control["rollout_id"] == ALGORITHM_ROLLOUTS - 1 and control["eval/held-out/paired_gain"] == 0.0
    bound = lower_bound(last)
    print(
        f"{name}: paired gain {last['eval/held-out/paired_gain']:.4f} (std {last['eval/held-out/paired_gain_std']:.4f}), bound {bound:.4f}"
    )
    assert bound > 0.0


def test_the_algorithms_train_as_they_say(demo, tmp_path_factory):
    """What each run trained on: GRPO-Guard's first step at the rollout's own weights has its
    normalised ratio at 1, its steps reweighted by 1/|dt|; MixGRPO trained only its window's steps, and the window moved;
    DPO trained one pair per group whose rewards differ."""
    guard = algorithm_run(demo, tmp_path_factory, "grpo_guard")[0]
    # Its old means are the trainer's own forward (the bias term is exactly 0 then); the old
    # log-probs are the engine's, which the flat micro-batches recompute to within rounding.
    assert guard[0]["train/ratio_mean_per_step"][0] == pytest.approx(1.0, abs=1e-6)
    assert guard[0]["train/clipfrac_per_step"][0] == 0.0 and guard[0]["train/reweight_mean_per_step"][0] > 1.0
    mix = algorithm_run(demo, tmp_path_factory, "mixgrpo")[0]
    steps = [sorted(int(k.rsplit("_", 1)[1]) for k in r if k.startswith("train/log_prob_abs_diff_step_")) for r in mix]
    assert steps[:6] == [[0, 1, 2, 3, 4]] * 6 and steps[6:] == [[1, 2, 3, 4, 5]] * 6
    dpo = algorithm_run(demo, tmp_path_factory, "flow_dpo")[0]
    assert all(r["train/num_pairs"] + r["train/num_groups_without_preference"] == 2 for r in dpo)
    assert sum(r["train/num_pairs"] for r in dpo) >= 20


@pytest.mark.exercises("--kl-space")
def test_a_velocity_kl_keeps_the_policy_near_its_reference(demo, tmp_path_factory, learning, frozen):
    """The demo's run with a velocity-space KL term stays closer to the reference (LoRA off)
    than the same run without it (the learning run), by the guard's KL at rollout 9; the
    frozen control's KL is exactly 0."""
    records, _, _ = demo_run(
        demo, tmp_path_factory.mktemp("kl") / "run", "--num-rollout", "10", "--diffusion-kl-beta", "0.1", "--kl-space", "velocity"
    )
    with_kl = evaluations(records)[-1]
    without = next(r for r in evaluations(learning[0]) if r["rollout_id"] == 9)
    assert with_kl["rollout_id"] == 9
    print(f"guard KL at rollout 9: {with_kl['guard/kl']:.3g} with the velocity KL, {without['guard/kl']:.3g} without")
    assert 0.0 < with_kl["guard/kl"] < 0.25 * without["guard/kl"]
    assert evaluations(frozen[0])[1]["guard/kl"] == 0.0
