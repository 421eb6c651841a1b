"""The reference's default SDE window ``[0, num_inference_steps)``:
``--diffusion-sde-window-range lo,T`` is accepted, drawn as flow_grpo draws it, and a window
that reaches the last step keeps that step as the deterministic (ODE) step, untrained."""

from __future__ import annotations

import random

import pytest

from miles_core.config.resolve import resolve_config
from miles_core.errors import ConfigError
from miles_core.step_strategies import StepContext, StepSelection, sde_window
from tests.tiny_runs import run_metrics, tiny_run_args

SD35 = ["--hf-checkpoint", "stabilityai/stable-diffusion-3.5-medium", "--rollout-batch-size", "2"]


def ctx(seed: int, n: int, window: tuple[int, int] | None, steps: int = 10) -> StepContext:
    return StepContext(num_steps=steps, num_sde_steps=n, window_range=window, candidate_steps=None, seed=seed, epoch=0, rollout_seed=42)


@pytest.mark.parametrize("steps,window,n", [(10, (0, 10), 3), (10, (0, 10), 1), (10, (4, 10), 6), (4, (0, 4), 2), (10, (2, 7), 2)])
def test_the_window_start_is_flow_grpos_draw_over_the_given_range(steps, window, n):
    lo, hi = window
    starts = set()
    for seed in range(400):
        # flow_grpo: random.randint(lo, hi - size), inclusive, seeded here by the request seed.
        start = random.Random(seed).randint(lo, hi - n)
        starts.add(start)
        window_steps = set(range(start, start + n))
        selection = sde_window(ctx(seed, n, window, steps))
        # Every step of the drawn window is an SDE step but the last step T - 1, which stays ODE.
        assert selection.sde_steps == tuple(sorted(window_steps - {steps - 1}))
        assert selection.return_steps[-1] == steps
    assert starts == set(range(lo, hi - n + 1))  # the draws cover every start, the last one included


def test_a_window_drawn_onto_the_last_step_trains_one_step_fewer():
    # Seeds whose draw over [0, 10) with n = 3 starts at 7: the window 7, 8, 9 holds the last step.
    onto_last = [seed for seed in range(200) if random.Random(seed).randint(0, 7) == 7]
    assert onto_last  # the case is reached
    for seed in onto_last:
        selection = sde_window(ctx(seed, 3, (0, 10)))
        assert selection == StepSelection(sde_steps=(7, 8), return_steps=(7, 8, 9, 10))
    # n = 1 on the last step: no SDE step at all, only the final latent.
    seed = next(s for s in range(200) if random.Random(s).randint(0, 9) == 9)
    assert sde_window(ctx(seed, 1, (0, 10))) == StepSelection(sde_steps=(), return_steps=(10,))
    # Control: a window off the last step keeps all n steps.
    off = next(s for s in range(200) if random.Random(s).randint(0, 7) == 3)
    assert sde_window(ctx(off, 3, (0, 10))).sde_steps == (3, 4, 5)


@pytest.mark.exercises("--diffusion-sde-window-range")
def test_window_bounds_up_to_the_step_count():
    assert resolve_config([*SD35, "--diffusion-num-sde-steps", "9", "--diffusion-sde-window-range", "0,10"]).diffusion_sde_window_range == (
        0,
        10,
    )
    with pytest.raises(ConfigError) as refused:
        resolve_config([*SD35, "--diffusion-num-sde-steps", "2", "--diffusion-sde-window-range", "0,11"])
    assert refused.value.messages == [
        "--diffusion-sde-window-range 0,11: need 0 <= lo < hi <= --diffusion-num-steps 10 "
        "(a window reaching the last step runs it deterministically)"
    ]
    with pytest.raises(ValueError, match=r"^sde_window: --diffusion-sde-window-range 0,11: need 0 <= lo < hi <= --diffusion-num-steps 10 "):
        sde_window(ctx(0, 2, (0, 11)))


@pytest.mark.exercises("--diffusion-sde-window-range", "--save-debug-train-data")
def test_a_tiny_run_with_the_references_default_window_trains(tiny_sd3, prompts, tmp_path):
    from miles_core.training.debug_data import load_train_data

    steps, n = 4, 2
    args = tiny_run_args(tiny_sd3, prompts, tmp_path / "run", steps=steps, sde_steps=n)
    dump = tmp_path / "train" / "{}.msgpack"
    (record,) = run_metrics(
        [*args, "--num-rollout", "1", "--diffusion-sde-window-range", f"0,{steps}", "--save-debug-train-data", str(dump)]
    )
    # Rollout 0: 2 prompt groups of 4 samples (--rollout-seed 42), microgroups of 2 at seeds
    # 42 + 4 g + {0, 2}; each draws its window start over [0, T - n] and trains n steps, or
    # n - 1 when its window ends on the last step.
    seeds = [42 + 4 * g + offset for g in (0, 1) for offset in (0, 2)]
    trained = [n - 1 if random.Random(seed).randint(0, steps - n) == steps - n else n for seed in seeds]
    assert 1 in trained and 2 in trained  # both cases occur in this rollout
    assert record["train/num_pairs"] == 2 * sum(trained) == 12
    pairs = load_train_data(tmp_path / "train" / "0.msgpack")["pairs"]
    assert len(pairs["step"]) == 12 and steps - 1 not in set(pairs["step"].tolist())
    assert record["train/grad_norm_per_step"][0] > 0
