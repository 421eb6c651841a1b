"""MixGRPO's sliding window (``--diffusion-step-strategy-path mixgrpo``): the window over
rollout ids against tables written by hand from MixGRPO's rule (Tencent-Hunyuan/MixGRPO
fastvideo/utils/grpo_states.py, progressive with roll-back), the flags that move it, the
configuration errors, and a training run whose SDE steps move between rollouts."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from miles_algorithms import plugin
from miles_algorithms.mixgrpo import mixgrpo, window_start
from miles_core.api import ConfigError, StepContext, StepSelection, resolve_config
from miles_core.cli.main import main
from miles_core.step_strategies import select_steps

from ._tiny_run import tiny_run

BASE = ["--hf-checkpoint", "stabilityai/stable-diffusion-3.5-medium", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2"]


def ctx(rollout_id: int, *, steps: int = 10, n: int = 4, config=None, seed: int = 0, epoch: int = 0) -> StepContext:
    return StepContext(
        num_steps=steps,
        num_sde_steps=n,
        window_range=None,
        candidate_steps=None,
        seed=seed,
        epoch=epoch,
        rollout_seed=0,
        rollout_id=rollout_id,
        config=config,
    )


def flags(interval: int, stride: int = 1) -> SimpleNamespace:
    return SimpleNamespace(mixgrpo_shift_interval=interval, mixgrpo_shift_stride=stride)


def windows(count: int, **kwargs) -> list[tuple[int, ...]]:
    return [mixgrpo(ctx(r, **kwargs)).sde_steps for r in range(count)]


# T = 10 (SDE-able steps 0..8), n = 4, interval 2, stride 1: the start moves by 1 every 2
# rollouts; the window is clipped at step 8; after the start 8 = T - 2 it rolls back to 0.
TABLE_T10_N4_I2 = [
    (0, 1, 2, 3), (0, 1, 2, 3),
    (1, 2, 3, 4), (1, 2, 3, 4),
    (2, 3, 4, 5), (2, 3, 4, 5),
    (3, 4, 5, 6), (3, 4, 5, 6),
    (4, 5, 6, 7), (4, 5, 6, 7),
    (5, 6, 7, 8), (5, 6, 7, 8),
    (6, 7, 8), (6, 7, 8),
    (7, 8), (7, 8),
    (8,), (8,),
    (0, 1, 2, 3), (0, 1, 2, 3),
]  # fmt: skip


def test_the_window_follows_mixgrpos_rule_over_rollouts():
    assert windows(20, config=flags(2)) == TABLE_T10_N4_I2
    # Control: another interval gives another table (3 rollouts per start).
    assert windows(20, config=flags(3))[:7] == [(0, 1, 2, 3)] * 3 + [(1, 2, 3, 4)] * 3 + [(2, 3, 4, 5)]
    assert windows(20, config=flags(3)) != TABLE_T10_N4_I2
    # A stride of 3: starts 0, 3, 6 (9 > T - 2 rolls back), one rollout each.
    assert windows(5, config=flags(1, 3)) == [(0, 1, 2, 3), (3, 4, 5, 6), (6, 7, 8), (0, 1, 2, 3), (3, 4, 5, 6)]
    # A stride of n: MixGRPO without --prog_overlap, the windows tile the steps.
    assert windows(4, config=flags(1, 4)) == [(0, 1, 2, 3), (4, 5, 6, 7), (8,), (0, 1, 2, 3)]
    assert [window_start(r, 10, 2, 1) for r in range(0, 20, 2)] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 0]


def test_every_request_of_a_rollout_gets_the_same_window_and_ode_elsewhere():
    first = mixgrpo(ctx(5, config=flags(2)))
    assert {mixgrpo(ctx(5, config=flags(2), seed=s, epoch=e)) for s in (0, 1, 99) for e in (0, 3)} == {first}
    # SDE steps 2..5; the engine returns their latents and the final one; the rest is ODE.
    assert first == StepSelection(sde_steps=(2, 3, 4, 5), return_steps=(2, 3, 4, 5, 6, 10))


def test_outside_a_run_the_flags_defaults_apply():
    # Interval 25, stride 1: the window moves after 25 rollouts.
    assert windows(27) == [(0, 1, 2, 3)] * 25 + [(1, 2, 3, 4)] * 2
    assert mixgrpo(ctx(25, config=SimpleNamespace())).sde_steps == (1, 2, 3, 4)  # a config without the flags


@pytest.mark.exercises("--mixgrpo-shift-interval", "--mixgrpo-shift-stride")
def test_the_flags_move_the_window_of_a_resolved_configuration():
    def table(*extra: str) -> list[tuple[int, ...]]:
        config = resolve_config(
            [*BASE, "--diffusion-num-steps", "10", "--diffusion-num-sde-steps", "4", "--diffusion-step-strategy-path", "mixgrpo", *extra]
        )
        return [select_steps(config, seed=0, epoch=0, strategy=mixgrpo, rollout_id=r).sde_steps for r in range(20)]

    assert table("--mixgrpo-shift-interval", "2") == TABLE_T10_N4_I2
    assert table("--mixgrpo-shift-interval", "2", "--mixgrpo-shift-stride", "3")[:8:2] == [
        (0, 1, 2, 3),
        (3, 4, 5, 6),
        (6, 7, 8),
        (0, 1, 2, 3),
    ]
    with pytest.raises(ConfigError, match=r"^--mixgrpo-shift-interval 0: must be at least 1$"):
        table("--mixgrpo-shift-interval", "0")


def test_a_window_larger_than_the_sde_steps_is_a_one_line_error(capsys):
    args = [*BASE, "--diffusion-num-steps", "10", "--diffusion-step-strategy-path", "mixgrpo"]
    with pytest.raises(ConfigError) as info:
        resolve_config([*args, "--diffusion-num-sde-steps", "10"])
    (line,) = info.value.messages
    assert "--diffusion-num-sde-steps 10" in line and "--diffusion-num-steps 10 - 1" in line
    with pytest.raises(ConfigError) as info:
        resolve_config([*args, "--diffusion-num-sde-steps", "0"])
    assert info.value.messages == [
        "--diffusion-step-strategy-path mixgrpo: --diffusion-num-sde-steps 0 (the window's size) must be between 1 and "
        "--diffusion-num-steps 10 - 1 (the window slides over the steps that can be SDE steps; the last step never is)"
    ]
    assert main(["config", *args, "--diffusion-num-sde-steps", "0"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    # The plugin's own check holds whatever the core checks first.
    config = SimpleNamespace(
        diffusion_step_strategy_path="mixgrpo", diffusion_num_steps=10, diffusion_num_sde_steps=10, diffusion_sde_window_range=None
    )
    config.get = lambda dest: getattr(config, dest, None)
    (message,) = plugin.miles_validate_config(config)
    assert message.startswith("--diffusion-step-strategy-path mixgrpo: --diffusion-num-sde-steps 10 (the window's size)")
    config.diffusion_step_strategy_path = None  # control: another strategy is not checked
    assert plugin.miles_validate_config(config) == []
    with pytest.raises(ValueError, match="mixgrpo: --diffusion-num-sde-steps 10"):
        mixgrpo(ctx(0, n=10))


def test_the_other_strategies_window_flags_are_refused():
    with pytest.raises(ConfigError) as info:
        resolve_config(
            [
                *BASE,
                "--diffusion-num-steps",
                "10",
                "--diffusion-num-sde-steps",
                "2",
                "--diffusion-step-strategy-path",
                "mixgrpo",
                "--diffusion-sde-window-range",
                "0,5",
            ]
        )
    assert info.value.messages == [
        "--diffusion-sde-window-range has no effect with --diffusion-step-strategy-path mixgrpo (its window slides over "
        "every step but the last, placed by --mixgrpo-shift-interval and --mixgrpo-shift-stride); drop it"
    ]


def test_a_training_run_moves_its_sde_steps_between_rollouts(tiny_sd3, prompts, tmp_path):
    # T = 4 (SDE-able steps 0..2), n = 2, interval 1: {0, 1}, {1, 2}, {2}, then back to {0, 1}.
    config, records = tiny_run(
        tiny_sd3,
        prompts,
        tmp_path / "run",
        "--diffusion-step-strategy-path",
        "mixgrpo",
        "--diffusion-num-sde-steps",
        "2",
        "--mixgrpo-shift-interval",
        "1",
        "--num-rollout",
        "4",
    )
    assert config.components["step_strategy"].provider.startswith("miles-algorithms ")
    trained = [sorted(int(k.rsplit("_", 1)[1]) for k in r if k.startswith("train/log_prob_abs_diff_step_")) for r in records]
    assert trained == [[0, 1], [1, 2], [2], [0, 1]]
    assert [r["train/num_pairs"] for r in records] == [4, 4, 2, 4]
    assert all(r["train/log_prob_max_abs_diff"] < 1e-5 for r in records)
