"""Step strategies: which steps run the SDE, which latents come back, and the config
rules that keep the last step (sigma' = 0) out of the SDE (a window reaching it:
tests/test_seed_window.py)."""

from types import SimpleNamespace

import pytest
import torch

from miles_core.config.resolve import resolve_config
from miles_core.errors import ConfigError
from miles_core.plugin_manager import PluginHost
from miles_core.step_strategies import (
    StepContext,
    StepSelection,
    epoch_global_random_choice,
    ode_and_return_last,
    sde_window,
    select_steps,
)

torch.set_num_threads(1)

BASE = ["--hf-checkpoint", "stabilityai/stable-diffusion-3.5-medium", "--rollout-batch-size", "2"]


def ctx(**overrides):
    fields = {"num_steps": 10, "num_sde_steps": 3, "window_range": None, "candidate_steps": None, "seed": 7, "epoch": 0, "rollout_seed": 42}
    return StepContext(**{**fields, **overrides})


def assert_pairs_returned(selection, num_steps):
    assert selection.return_steps[-1] == num_steps
    for k in selection.sde_steps:
        assert {k, k + 1} <= set(selection.return_steps)
    assert set(selection.return_steps) == {num_steps, *selection.sde_steps, *(k + 1 for k in selection.sde_steps)}


# -- sde_window ----------------------------------------------------------------------


def test_sde_window_known_seed():
    assert sde_window(ctx(seed=7)) == StepSelection(sde_steps=(2, 3, 4), return_steps=(2, 3, 4, 5, 10))
    assert sde_window(ctx(seed=7, num_sde_steps=2, window_range=(3, 8))) == sde_window(ctx(seed=7, num_sde_steps=2, window_range=(3, 8)))


@pytest.mark.parametrize("window_range,n", [(None, 3), ((2, 6), 2), ((0, 9), 9), ((4, 5), 1), (None, 1)])
def test_sde_window_is_contiguous_inside_range(window_range, n):
    lo, hi = window_range or (0, 9)
    starts = set()
    for seed in range(300):
        selection = sde_window(ctx(seed=seed, num_sde_steps=n, window_range=window_range))
        steps = selection.sde_steps
        assert steps == tuple(range(steps[0], steps[0] + n))
        assert lo <= steps[0] and steps[-1] < hi
        assert 9 not in steps  # the last step of 10
        assert_pairs_returned(selection, 10)
        starts.add(steps[0])
    # Every admissible start is drawn for some seed: the draw covers [lo, hi - n].
    assert starts == set(range(lo, hi - n + 1))


def test_sde_window_is_deterministic_per_seed_and_varies_across_seeds():
    assert all(sde_window(ctx(seed=s)) == sde_window(ctx(seed=s)) for s in range(50))
    # Control: the seed matters (some other seed picks another start).
    assert len({sde_window(ctx(seed=s)).sde_steps[0] for s in range(50)}) > 1
    # Nothing but the seed matters: epoch and rollout seed do not move the window.
    assert sde_window(ctx(seed=3, epoch=5, rollout_seed=1)) == sde_window(ctx(seed=3))


def test_sde_window_ignores_global_random_state():
    import random

    random.seed(0)
    first = sde_window(ctx(seed=11))
    random.seed(12345)
    random.random()
    assert sde_window(ctx(seed=11)) == first


def test_sde_window_zero_steps_is_ode():
    assert sde_window(ctx(num_sde_steps=0)) == StepSelection(sde_steps=(), return_steps=(10,))


def test_last_step_never_selected_across_seeds():
    for seed in range(500):
        for num_steps in (2, 3, 10):
            selection = sde_window(ctx(seed=seed, num_steps=num_steps, num_sde_steps=1))
            assert num_steps - 1 not in selection.sde_steps
            assert (
                num_steps - 1
                not in epoch_global_random_choice(
                    ctx(num_steps=num_steps, num_sde_steps=1, candidate_steps=tuple(range(num_steps - 1)), epoch=seed)
                ).sde_steps
            )


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"num_sde_steps": 4, "window_range": (2, 5)}, "sde_window: --diffusion-num-sde-steps 4 does not fit in the window [2, 5)"),
        ({"num_sde_steps": 10}, "sde_window: --diffusion-num-sde-steps 10 does not fit in the window [0, 9)"),
        (
            {"window_range": (0, 11)},
            (
                "sde_window: --diffusion-sde-window-range 0,11: need 0 <= lo < hi <= --diffusion-num-steps 10 "
                "(a window reaching the last step 9 runs it deterministically)"
            ),
        ),
        (
            {"window_range": (5, 5)},
            (
                "sde_window: --diffusion-sde-window-range 5,5: need 0 <= lo < hi <= --diffusion-num-steps 10 "
                "(a window reaching the last step 9 runs it deterministically)"
            ),
        ),
        ({"num_sde_steps": -1}, "sde_window: --diffusion-num-sde-steps -1 must not be negative"),
    ],
)
def test_sde_window_impossible_requests(overrides, message):
    with pytest.raises(ValueError) as caught:
        sde_window(ctx(**overrides))
    assert str(caught.value) == message


# -- epoch_global_random_choice --------------------------------------------------------


def test_epoch_choice_known_values():
    c = {"num_sde_steps": 2, "candidate_steps": (1, 3, 5, 7), "rollout_seed": 42}
    assert epoch_global_random_choice(ctx(**c, epoch=0)) == StepSelection(sde_steps=(3, 5), return_steps=(3, 4, 5, 6, 10))
    assert epoch_global_random_choice(ctx(**c, epoch=1)).sde_steps == (1, 5)


def test_epoch_choice_is_shared_by_every_sample_of_an_epoch():
    c = {"num_sde_steps": 2, "candidate_steps": (1, 2, 3, 4, 5, 6), "epoch": 3}
    choices = {epoch_global_random_choice(ctx(**c, seed=seed)) for seed in range(100)}
    assert len(choices) == 1
    (selection,) = choices
    assert len(selection.sde_steps) == 2 and set(selection.sde_steps) <= {1, 2, 3, 4, 5, 6}
    assert_pairs_returned(selection, 10)
    # The candidates' spelling order does not change the draw.
    assert epoch_global_random_choice(ctx(**{**c, "candidate_steps": (6, 5, 4, 3, 2, 1)})) == selection


def test_epoch_choice_changes_with_epoch_and_rollout_seed():
    c = {"num_sde_steps": 2, "candidate_steps": (0, 1, 2, 3, 4, 5, 6, 7, 8)}
    by_epoch = {epoch_global_random_choice(ctx(**c, epoch=e)).sde_steps for e in range(20)}
    assert len(by_epoch) > 1  # control: the epoch matters
    by_seed = {epoch_global_random_choice(ctx(**c, rollout_seed=s)).sde_steps for s in range(20)}
    assert len(by_seed) > 1
    assert all(epoch_global_random_choice(ctx(**c, epoch=e)) == epoch_global_random_choice(ctx(**c, epoch=e)) for e in range(20))


def test_epoch_choice_all_candidates_and_zero():
    assert epoch_global_random_choice(ctx(num_sde_steps=3, candidate_steps=(5, 1, 3))).sde_steps == (1, 3, 5)
    assert epoch_global_random_choice(ctx(num_sde_steps=0, candidate_steps=(1, 2))) == StepSelection((), (10,))


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"candidate_steps": None}, "epoch_global_random_choice requires --diffusion-sde-candidate-steps (e.g. 1,2,3)"),
        (
            {"num_sde_steps": 3, "candidate_steps": (1, 2)},
            "epoch_global_random_choice: --diffusion-num-sde-steps 3 exceeds the 2 --diffusion-sde-candidate-steps",
        ),
        (
            {"candidate_steps": (1, 9, 12)},
            ("epoch_global_random_choice: --diffusion-sde-candidate-steps [9, 12] outside [0, 9) (the last step is never an SDE step)"),
        ),
        ({"candidate_steps": (1, 2, 2, 3)}, "epoch_global_random_choice: --diffusion-sde-candidate-steps [1, 2, 2, 3] repeats a step"),
    ],
)
def test_epoch_choice_impossible_requests(overrides, message):
    with pytest.raises(ValueError) as caught:
        epoch_global_random_choice(ctx(**overrides))
    assert str(caught.value) == message


# -- ode_and_return_last and select_steps ------------------------------------------------


def test_ode_and_return_last():
    assert ode_and_return_last(ctx(num_sde_steps=4)) == StepSelection(sde_steps=(), return_steps=(10,))
    assert ode_and_return_last(ctx(num_steps=3)).return_steps == (3,)


def test_select_steps_reads_the_flags():
    config = SimpleNamespace(
        diffusion_num_steps=8,
        diffusion_num_sde_steps=2,
        diffusion_sde_window_range=[1, 6],
        diffusion_sde_candidate_steps=[2, 4, 6],
        rollout_seed=5,
    )
    seen = []

    def spy(c):
        seen.append(c)
        return ode_and_return_last(c)

    assert select_steps(config, seed=123, epoch=4, strategy=spy, rollout_id=9) == StepSelection((), (8,))
    assert seen == [
        StepContext(
            num_steps=8,
            num_sde_steps=2,
            window_range=(1, 6),
            candidate_steps=(2, 4, 6),
            seed=123,
            epoch=4,
            rollout_seed=5,
            rollout_id=9,
        )
    ]


@pytest.mark.exercises("--diffusion-sde-window-range", "--diffusion-num-sde-steps")
def test_select_steps_on_a_resolved_config():
    config = resolve_config([*BASE, "--diffusion-num-sde-steps", "2", "--diffusion-sde-window-range", "3,6"])
    selection = select_steps(config, seed=7, epoch=0, strategy=sde_window)
    assert selection.sde_steps in {(3, 4), (4, 5)}
    assert selection.return_steps[-1] == 10


# -- StepSelection validation ---------------------------------------------------------


@pytest.mark.parametrize(
    "sde,ret,message",
    [
        (
            (8,),
            (8, 9),
            ("StepSelection.sde_steps: step 8 is the last step (T = 9, the largest of return_steps; sigma' = 0) and is never an SDE step"),
        ),
        (
            (9,),
            (9, 10),
            ("StepSelection.sde_steps: step 9 is the last step (T = 10, the largest of return_steps; sigma' = 0) and is never an SDE step"),
        ),
        ((3, 2), (2, 3, 4, 10), "StepSelection.sde_steps [3, 2] must be sorted and without repeats"),
        ((2, 2), (2, 3, 10), "StepSelection.sde_steps [2, 2] must be sorted and without repeats"),
        ((), (10, 4), "StepSelection.return_steps [10, 4] must be sorted and without repeats"),
        ((12,), (10,), "StepSelection.sde_steps: step 12 is outside [0, 9]"),
        ((), (-1, 10), "StepSelection.return_steps: step -1 is outside [0, 10]"),
        ((2,), (2, 10), "StepSelection.return_steps [2, 10] must include latents 2 and 3 of SDE step 2"),
        ((2,), (3, 10), "StepSelection.return_steps [3, 10] must include latents 2 and 3 of SDE step 2"),
        ((), (), "StepSelection.return_steps [] must end with the final latent T >= 1"),
        (("1",), (10,), "StepSelection.sde_steps: '1' is not an int"),
    ],
)
def test_step_selection_validation(sde, ret, message):
    with pytest.raises(ValueError) as caught:
        StepSelection(sde_steps=sde, return_steps=ret)
    assert str(caught.value) == message


def test_step_selection_build():
    assert StepSelection.build([4, 2], 10) == StepSelection(sde_steps=(2, 4), return_steps=(2, 3, 4, 5, 10))
    assert StepSelection.build((), 1).return_steps == (1,)
    with pytest.raises(ValueError, match=r"^SDE step 9 is outside \[0, 9\) for 10 steps"):
        StepSelection.build((9,), 10)


# -- registration ---------------------------------------------------------------------


def test_builtins_are_registered():
    host = PluginHost(strict=True)
    registry = host.registries.step_strategy
    assert {"sde_window", "epoch_global_random_choice", "ode_and_return_last"} <= set(registry.names())
    assert registry.get("sde_window").load() is sde_window
    assert registry.get("epoch_global_random_choice").load() is epoch_global_random_choice
    assert registry.get("ode_and_return_last").load() is ode_and_return_last


def test_strategy_path_flag_resolves():
    config = resolve_config([*BASE, "--diffusion-step-strategy-path", "miles_core.step_strategies.epoch_global_random_choice"])
    assert config.components["step_strategy"].name == "miles_core.step_strategies.epoch_global_random_choice"


# -- configuration rules --------------------------------------------------------------


def config_errors(*extra):
    with pytest.raises(ConfigError) as caught:
        resolve_config([*BASE, *extra])
    return caught.value.messages


@pytest.mark.parametrize(
    "extra,expected",
    [
        (
            ["--diffusion-sde-window-range", "0,11"],
            (
                "--diffusion-sde-window-range 0,11: need 0 <= lo < hi <= --diffusion-num-steps 10 "
                "(a window reaching the last step runs it deterministically)"
            ),
        ),
        (
            ["--diffusion-num-steps", "6", "--diffusion-sde-window-range", "5,6"],
            (
                "--diffusion-sde-window-range 5,6: the window holds only the last step (--diffusion-num-steps 6 - 1), "
                "which is never an SDE step: nothing would be trained"
            ),
        ),
        (
            ["--diffusion-sde-window-range", "2,4", "--diffusion-num-sde-steps", "3"],
            "--diffusion-sde-window-range 2,4: the window holds 2 step(s), fewer than --diffusion-num-sde-steps 3",
        ),
        (
            ["--diffusion-num-sde-steps", "10"],
            "--diffusion-num-sde-steps 10 exceeds --diffusion-num-steps 10 - 1 (the last step is never an SDE step)",
        ),
        (
            ["--diffusion-sde-candidate-steps", "1,9,10"],
            ("--diffusion-sde-candidate-steps 9,10: need 0 <= step < --diffusion-num-steps 10 - 1 (the last step is never an SDE step)"),
        ),
        (
            ["--diffusion-sde-candidate-steps", "1,2", "--diffusion-num-sde-steps", "3"],
            "--diffusion-sde-candidate-steps 1,2: 2 step(s), fewer than --diffusion-num-sde-steps 3",
        ),
        (["--diffusion-sde-candidate-steps", "1,2,1"], "--diffusion-sde-candidate-steps 1,2,1: a step is repeated"),
    ],
)
@pytest.mark.exercises(
    "--diffusion-num-steps", "--diffusion-num-sde-steps", "--diffusion-sde-window-range", "--diffusion-sde-candidate-steps"
)
def test_config_step_rules(extra, expected):
    assert config_errors(*extra) == [expected]


def test_config_accepts_valid_step_flags():
    config = resolve_config(
        [
            *BASE,
            "--diffusion-num-sde-steps",
            "9",
            "--diffusion-sde-window-range",
            "0,9",
            "--diffusion-sde-candidate-steps",
            "0,1,2,3,4,5,6,7,8",
        ]
    )
    assert config.diffusion_sde_window_range == (0, 9)
    resolve_config([*BASE, "--diffusion-num-sde-steps", "2", "--diffusion-sde-candidate-steps", "3,1"])
