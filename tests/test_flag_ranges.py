"""Every numeric flag declares its valid range (``Flag.range``), and the configuration
enforces each one: a walker builds, for every numeric flag of the core and of the
installed plugins, values just outside the range and runs ``miles-core config`` in
process, expecting exit status 2 and a one-line error naming the flag; values exactly
at an inclusive bound are accepted."""

from __future__ import annotations

import math
import re

import pytest

from miles_core.cli.main import main
from miles_core.config.flag import NUMERIC_TYPES, Flag, ValueRange
from miles_core.config.parser import flag_entries
from miles_core.config.reference_flags import FLAGS
from miles_core.plugin_manager import get_host

PROG = "miles-core config"


def numeric_flags() -> list[Flag]:
    """The numeric flags of the core and of every installed plugin."""
    return [entry.flag for entry in flag_entries(get_host().flags).values() if entry.flag.type in NUMERIC_TYPES]


def step(bound: float) -> float:
    """A small step off a float bound, relative to its size."""
    return 1e-6 * max(1.0, abs(bound))


def outside_values(flag: Flag) -> list[float]:
    """Values just outside the flag's range: an integer flag's bound -1 / +1; a float
    flag's inclusive bound moved by a small step, its exclusive bound itself, an
    excluded infinity, and NaN."""
    r = flag.value_range
    assert r is not None
    values: list[float] = []
    if flag.integer:
        if math.isfinite(r.low):
            values.append(int(r.low) - 1)
        if math.isfinite(r.high):
            values.append(int(r.high) + 1)
        return values
    if math.isfinite(r.low):
        values.append(r.low - step(r.low) if r.low_closed else r.low)
    elif not r.low_closed:
        values.append(-math.inf)
    if math.isfinite(r.high):
        values.append(r.high + step(r.high) if r.high_closed else r.high)
    elif not r.high_closed:
        values.append(math.inf)
    values.append(math.nan)
    return values


def inclusive_bounds(flag: Flag) -> list[float]:
    r = flag.value_range
    assert r is not None
    bounds = [b for b, closed in ((r.low, r.low_closed), (r.high, r.high_closed)) if closed and math.isfinite(b)]
    return [int(b) for b in bounds] if flag.integer else bounds


def cli_value(flag: Flag, value: float) -> tuple[str, str]:
    """``(argument, shown)``: the ``--flag=VALUE`` argument (``=`` so that a negative
    value is not read as an option) and the value as the error line shows it. A pair
    gets an in-range second item above its low bound (a window ``lo,hi`` needs lo < hi)."""
    if flag.type == "int_pair":
        low = flag.value_range.low
        items = [value, int(low) + 1 if math.isfinite(low) else int(flag.value_range.high)]
        shown = ",".join(str(item) for item in items)
        return f"{flag.name}={shown}", shown
    shown = str(int(value) if flag.integer else float(value))
    return f"{flag.name}={shown}", shown


def range_lines(stderr: str, flag_name: str, prog: str = PROG) -> list[str]:
    """The error lines reporting ``flag_name`` outside its range."""
    pattern = re.compile(rf"^{re.escape(prog)}: error: {re.escape(flag_name)} \S+: (each value )?must ")
    return [line for line in stderr.splitlines() if pattern.match(line)]


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(argv)
    return code, capsys.readouterr().err


@pytest.fixture(scope="module")
def base(tiny_sd3, prompts) -> list[str]:
    return ["--hf-checkpoint", str(tiny_sd3), "--prompt-data", str(prompts), "--rollout-batch-size", "1"]


# -- the records -------------------------------------------------------------------------------


def test_every_numeric_flag_declares_a_range():
    core = [flag.name for flag in FLAGS if flag.type in NUMERIC_TYPES and flag.range is None]
    assert core == []
    flags = numeric_flags()
    owners = {entry.owner.name for entry in flag_entries(get_host().flags).values() if entry.flag.type in NUMERIC_TYPES}
    assert "rewards" in owners  # the plugins' flags are walked too
    assert [flag.name for flag in flags if flag.range is None] == []
    # Every integer flag has a finite bound, so the walker has a value to try.
    assert [flag.name for flag in flags if not outside_values(flag)] == []


@pytest.mark.parametrize(
    "text, problem",
    [
        ("[1, inf", "is not an interval"),
        ("1, inf)", "is not an interval"),
        ("[1; 2]", "is not an interval"),
        ("[a, 2)", "bounds must be numbers"),
        ("(1, 1)", "is empty"),
        ("[2, 1]", "is empty"),
        ("[inf, inf]", "low bound must be below inf"),
        ("[0, nan]", "bounds must be numbers"),
    ],
)
def test_a_malformed_range_is_an_error_naming_the_flag(text, problem):
    with pytest.raises(ValueError, match=rf"^flag --x-y: range {re.escape(repr(text))}.*{problem}"):
        Flag(name="--x-y", group="general", type="float", range=text)


def test_a_range_must_fit_the_flag():
    with pytest.raises(ValueError, match=r"^flag --x-y: a range applies to numeric flags"):
        Flag(name="--x-y", group="general", type="str", range="[0, 1]")
    for text in ("(0, inf)", "[0.5, 2]"):
        with pytest.raises(ValueError, match=r"^flag --x-y: range .*: an integer flag's finite bounds are closed integers"):
            Flag(name="--x-y", group="general", type="int", range=text)
    with pytest.raises(ValueError, match=r"^flag --x-y: default 0 is outside its range \[1, inf\)"):
        Flag(name="--x-y", group="general", type="int", default=0, range="[1, inf)")
    with pytest.raises(ValueError, match=r"^flag --x-y: default \(0, -1\) is outside its range \[0, inf\)"):
        Flag(name="--x-y", group="general", type="int_pair", default=(0, -1), range="[0, inf)")
    # Controls: the same records with fitting ranges and defaults.
    Flag(name="--x-y", group="general", type="int", default=1, range="[1, inf)")
    Flag(name="--x-y", group="general", type="int_pair", default=(0, 1), range="[0, inf)")


def test_interval_membership_and_wording():
    finite = ValueRange.parse("(-inf, inf)")
    assert 0.0 in finite and -1e300 in finite
    assert math.inf not in finite and -math.inf not in finite and math.nan not in finite
    assert math.inf in ValueRange.parse("[0, inf]") and math.nan not in ValueRange.parse("[0, inf]")
    half_open = ValueRange.parse("[0, 1)")
    assert (0.0 in half_open, 1.0 in half_open, 1 - 1e-12 in half_open) == (True, False, True)
    assert str(ValueRange.parse(" ( 0 ,1 ] ")) == "(0, 1]"
    assert [
        ValueRange.parse("[1, inf)").rule(0),
        ValueRange.parse("[0, inf)").rule(-1),
        ValueRange.parse("(0, inf)").rule(0),
        ValueRange.parse("(0, inf)").rule(math.inf),
        ValueRange.parse("[0, inf)").rule(math.nan),
        ValueRange.parse("(2.5, inf)").rule(1),
        ValueRange.parse("(-inf, 3]").rule(4),
        ValueRange.parse("(-inf, inf)").rule(math.nan),
        ValueRange.parse("(0, 1]").rule(math.nan),
    ] == [
        "must be at least 1",
        "must not be negative",
        "must be positive",
        "must be a finite number > 0",
        "must be a finite number >= 0",
        "must be greater than 2.5",
        "must be at most 3",
        "must be a finite number",
        "must be in (0, 1]",
    ]


# -- the walker ----------------------------------------------------------------------------------


def test_the_minimal_arguments_are_valid(base, capsys):
    # Control for the walker: without the out-of-range value the same command line passes.
    code, err = run(["config", *base], capsys)
    assert code == 0, err


def test_every_value_outside_a_declared_range_is_a_one_line_error(base, capsys):
    tried = 0
    failures = []
    for flag in numeric_flags():
        for value in outside_values(flag):
            argument, shown = cli_value(flag, value)
            code, err = run(["config", *base, argument], capsys)
            lines = range_lines(err, flag.name)
            tried += 1
            if code != 2 or len(lines) != 1 or not lines[0].startswith(f"{PROG}: error: {flag.name} {shown}: "):
                failures.append((argument, code, err.strip().splitlines()))
    assert failures == []
    assert tried >= len(numeric_flags())  # at least one value per flag


def companions(flag_name: str, prompts, tmp_path) -> list[str]:
    """The flags a flag only goes with (the rules that need them are not ranges)."""
    return {
        "--diffusion-guidance-scale-2": ["--hf-checkpoint", "Wan-AI/Wan2.2-T2V-A14B-Diffusers"],  # Wan 2.2 reads it
        "--diffusion-true-cfg-scale": ["--hf-checkpoint", "Qwen/Qwen-Image"],  # Qwen-Image reads it
        "--rollout-num-engines": ["--rollout-engine", "http"],
        "--micro-batch-size-sample": ["--micro-batch-size-tstep", "1"],
        "--micro-batch-size-tstep": ["--micro-batch-size-sample", "1"],
        "--eval-interval": ["--eval-prompt-data", "eval", str(prompts)],
        "--lora-rank": ["--use-lora"],
        "--lora-alpha": ["--use-lora"],
        "--save-interval": ["--save", str(tmp_path / "save")],
        "--save-keep-last": ["--save", str(tmp_path / "save")],
        "--ckpt-step": ["--load", str(tmp_path / "load")],
        "--load-debug-rollout-data-subsample": ["--load-debug-rollout-data", "replay/{}.msgpack"],
    }.get(flag_name, [])


def test_values_at_an_inclusive_bound_are_accepted(base, prompts, capsys, tmp_path):
    checked = 0
    for flag in numeric_flags():
        for bound in inclusive_bounds(flag):
            argument, _ = cli_value(flag, bound)
            code, err = run(["config", *base, argument, *companions(flag.name, prompts, tmp_path)], capsys)
            assert (code, range_lines(err, flag.name)) == (0, []), (argument, err)
            checked += 1
    assert checked > len(numeric_flags()) // 2  # most ranges have an inclusive bound ((0, inf) has none)


def test_a_checkpoint_step_of_zero_still_requires_load(base, capsys):
    # 0 is a valid step, and it still needs --load (0 == False once let it through).
    code, err = run(["config", *base, "--ckpt-step", "0"], capsys)
    assert (code, err.splitlines()) == (2, [f"{PROG}: error: --ckpt-step requires --load"])


@pytest.mark.parametrize(
    "argument, line",
    [
        ("--rollout-microgroup-size=0", "--rollout-microgroup-size 0: must be at least 1"),
        ("--lr=-1e-06", "--lr -1e-06: must not be negative"),
        ("--adam-eps=0", "--adam-eps 0.0: must be positive"),
        ("--adam-beta2=1", "--adam-beta2 1.0: must be in [0, 1)"),
        ("--diffusion-flow-shift=inf", "--diffusion-flow-shift inf: must be a finite number > 0"),
        ("--ci-metric-checker-threshold=nan", "--ci-metric-checker-threshold nan: must be a finite number"),
        ("--seed=4294967296", "--seed 4294967296: must be in [0, 4294967295]"),
        ("--diffusion-sde-candidate-steps=2,-1", "--diffusion-sde-candidate-steps 2,-1: each value must not be negative"),
        ("--lora-rank=0", "--lora-rank 0: must be at least 1"),  # checked without --use-lora too
        ("--ocr-num-workers=0", "--ocr-num-workers 0: must be at least 1"),  # a plugin's flag
    ],
)
def test_the_error_line_names_the_flag_value_and_rule(base, capsys, argument, line):
    code, err = run(["config", *base, argument], capsys)
    assert code == 2
    assert f"{PROG}: error: {line}" in err.splitlines()


def test_train_refuses_a_zero_microgroup_size_before_anything_runs(base, capsys, tmp_path):
    # Unchecked, 0 reached the rollout loop and raised ZeroDivisionError there.
    out = tmp_path / "run"
    code, err = run(["train", *base, "--rollout-microgroup-size", "0", "--output-dir", str(out)], capsys)
    assert code == 2
    assert err.splitlines() == ["miles-core train: error: --rollout-microgroup-size 0: must be at least 1"]
    assert not out.exists()


def test_yaml_values_are_checked_like_command_line_values(base, capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout_microgroup_size: 0\nlr: -0.5\ndiffusion_noise_level: .nan\n")
    code, err = run(["config", *base, "--custom-config-path", str(bad)], capsys)
    assert code == 2
    assert [line for line in err.splitlines() if ": error: " in line] == [
        f"{PROG}: error: --lr -0.5: must not be negative",
        f"{PROG}: error: --rollout-microgroup-size 0: must be at least 1",
        f"{PROG}: error: --diffusion-noise-level nan: must be a finite number >= 0",
    ]
    good = tmp_path / "good.yaml"  # control: the same keys at their bounds
    good.write_text("rollout_microgroup_size: 1\nlr: 0\ndiffusion_noise_level: 0\n")
    code, err = run(["config", *base, "--custom-config-path", str(good)], capsys)
    assert code == 0, err
