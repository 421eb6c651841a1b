"""The ocr reward: the scoring rule, the Tesseract backend on rendered text, videos,
failures, --ocr-backend and --ocr-num-workers.

These tests need the Tesseract binary (Debian tesseract-ocr, installed by
scripts/install.sh); without it they fail, never skip.
"""

from __future__ import annotations

import itertools
import logging
import math
import shutil
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from miles_rewards import ocr
from miles_rewards.ocr import (
    FRAME_INTERVAL,
    OcrReward,
    OcrUnavailableError,
    levenshtein,
    normalize,
    ocr_score,
    target_text,
    video_reward,
)

BASE = [
    "--hf-checkpoint",
    "stabilityai/stable-diffusion-3.5-medium",
    "--rollout-batch-size",
    "2",
    "--n-samples-per-prompt",
    "2",
    "--diffusion-num-sde-steps",
    "2",
]


def render(text: str, size: tuple[int, int] = (512, 160), font_size: int = 48) -> torch.Tensor:
    """Black text on white, as the engine's output: float [3, H, W] in [0, 1]. Pillow's
    bundled FreeType font, so the rendering is the same on every machine."""
    image = Image.new("RGB", size, "white")
    ImageDraw.Draw(image).text((24, 48), text, fill="black", font=ImageFont.load_default(size=font_size))
    return torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255.0


BLANK = torch.ones(3, 160, 512)


def config(**values) -> SimpleNamespace:
    return SimpleNamespace(**{"ocr_backend": "tesseract", "ocr_num_workers": 1, **values})


# --- the installation ----------------------------------------------------------------


def test_tesseract_is_installed():
    assert shutil.which("tesseract"), (
        "the Tesseract binary is missing: run bash scripts/install.sh as root (it installs Debian's tesseract-ocr), "
        "or apt-get install tesseract-ocr"
    )
    import pytesseract

    assert "eng" in pytesseract.get_languages()


# --- the scoring rule ------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ('A neon sign that says "Open 24h" above a door', "Open 24h"),
        ('first "one" then "two"', "one"),  # the first pair only
        ('"at the start" of the prompt', "at the start"),
        ('empty quotes "" here', ""),
        ("no quotes at all", None),
        ('a single " quote', None),
    ],
)
def test_target_is_the_text_between_the_first_pair_of_double_quotes(prompt, expected):
    assert target_text(prompt) == expected


def test_normalisation_lowercases_and_removes_spaces():
    assert normalize("Hello  World ") == "helloworld"
    assert normalize("OPEN 24H!") == "open24h!"
    assert normalize("tab\there") == "tab\there"  # only spaces, as the reference


def _reference_levenshtein(a: str, b: str) -> int:
    if not a or not b:
        return len(a) + len(b)
    return min(
        _reference_levenshtein(a[1:], b) + 1,
        _reference_levenshtein(a, b[1:]) + 1,
        _reference_levenshtein(a[1:], b[1:]) + (a[0] != b[0]),
    )


def test_levenshtein():
    assert levenshtein("kitten", "sitting") == 3
    assert levenshtein("", "abc") == levenshtein("abc", "") == 3
    assert levenshtein("flaw", "lawn") == 2
    assert levenshtein("same", "same") == 0
    for a, b in itertools.product(["", "a", "ab", "ba", "abc", "cab", "abcd", "bcda", "aaab"], repeat=2):
        assert levenshtein(a, b) == levenshtein(b, a) == _reference_levenshtein(a, b), (a, b)


def test_score_formula():
    assert ocr_score("xx hello worldyy", "Hello World") == 1.0  # a substring
    # "helowrld" vs "helloworld": 2 insertions -> 1 - 2/10
    assert ocr_score("Helo wrld", "Hello World") == pytest.approx(0.8, abs=1e-12)
    assert ocr_score("", "Hello") == 0.0
    # Many unrelated characters: the distance is capped at the target's length.
    assert ocr_score("z" * 100, "abc") == 0.0
    assert ocr_score("abd", "abc") == pytest.approx(1 - 1 / 3)
    with pytest.raises(ValueError):
        ocr_score("anything", "   ")


def test_video_reward_is_the_mean_of_frames_above_zero():
    assert video_reward([1.0, 0.0, 0.5]) == 0.75
    assert video_reward([0.0, 0.0]) == 0.0
    assert video_reward([]) == 0.0


# --- Tesseract on rendered text ------------------------------------------------------------


def test_exact_misspelled_and_missing_text():
    reward = OcrReward(config())
    prompts = ['a poster that says "Hello World"'] * 3
    values = reward([render("Hello World"), render("Helo World"), BLANK], prompts)
    # "heloworld" read for target "helloworld": distance 1, not a substring -> 1 - 1/10.
    expected_misspelled = 1 - min(levenshtein("heloworld", "helloworld"), 10) / 10
    assert values == [1.0, pytest.approx(expected_misspelled, abs=1e-12), 0.0]
    assert expected_misspelled == pytest.approx(0.9)
    assert reward.failures == 0


def test_case_spacing_and_surrounding_text_do_not_matter():
    reward = OcrReward(config())
    image = render("Fresh BREAD daily", size=(640, 160))
    assert reward([image, image], ['"fresh bread"', '"FreshBread Daily"']) == [1.0, 1.0]


def test_uint8_grayscale_bfloat16_and_float_inputs_agree():
    reward = OcrReward(config())
    image = render("Open Sesame")
    as_uint8 = (image * 255).round().to(torch.uint8)
    gray = as_uint8[:1]
    prompts = ['"Open Sesame"'] * 4
    assert reward([image, as_uint8.numpy(), gray, image.to(torch.bfloat16)], prompts) == [1.0, 1.0, 1.0, 1.0]


def test_video_reads_every_fourth_frame_and_averages_frames_above_zero():
    target = 'a video of "Hello World"'
    frames = [BLANK] * 9
    frames[0] = render("Hello World")  # read: 1.0
    frames[4] = BLANK  # read: 0, left out of the mean
    frames[8] = render("Helo World")  # read: 0.9
    for skipped in (1, 2, 3, 5, 6, 7):  # never read: each would score 0.5 and lower the mean
        frames[skipped] = render("Hello")
    video = torch.stack(frames, dim=1)  # [C, F, H, W]
    assert FRAME_INTERVAL == 4
    reward = OcrReward(config())
    assert reward([video], [target]) == [pytest.approx((1.0 + 0.9) / 2, abs=1e-12)]
    # Every read frame blank: 0.
    assert reward([torch.stack([BLANK] * 5, dim=1)], [target]) == [0.0]


def test_video_frames_are_scored_with_the_image_rule_substring_included():
    # Documented difference from the reference's video_ocr, which scores each frame with
    # the capped distance alone: there this frame would score 1 - min(4, 10) / 10 = 0.6.
    reward = OcrReward(config(), backend=lambda frame: "xx Hello Worldyy")
    video = torch.stack([BLANK] * 5, dim=1)
    assert reward([video, BLANK], ['"Hello World"'] * 2) == [1.0, 1.0]
    assert 1 - min(levenshtein("xxhelloworldyy", "helloworld"), 10) / 10 == pytest.approx(0.6)


def test_prompt_without_quoted_text_gets_nan_and_one_warning(caplog):
    reward = OcrReward(config())
    with caplog.at_level(logging.WARNING, logger="miles_rewards.ocr"):
        values = reward([BLANK, BLANK, BLANK], ["no quotes here", '"" empty', '"abc"'])
        again = reward([BLANK], ["still no quotes"])
    assert math.isnan(values[0]) and math.isnan(values[1]) and values[2] == 0.0
    assert math.isnan(again[0])
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "no text between double quotes" in messages[0]


def test_recogniser_failure_scores_zero_with_a_warning(caplog, monkeypatch):
    reward = OcrReward(config())
    import pytesseract

    # The real failure path: the binary disappears after the reward was built.
    monkeypatch.setattr(pytesseract.pytesseract, "tesseract_cmd", "/nonexistent/tesseract")
    with caplog.at_level(logging.WARNING, logger="miles_rewards.ocr"):
        values = reward([render("Hello World"), render("Hello World")], ['"Hello World"'] * 2)
    assert values == [0.0, 0.0]
    assert reward.failures == 2
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 2 and all("tesseract recogniser failed" in w and "TesseractNotFoundError" in w for w in warnings)
    # A failing frame of a video is one frame at 0, left out of the mean.
    calls = iter([RuntimeError("boom"), "helloworld"])

    def flaky(frame):
        result = next(calls)
        if isinstance(result, Exception):
            raise result
        return result

    video = torch.stack([BLANK] * 5, dim=1)
    assert OcrReward(config(), backend=flaky)([video], ['"Hello World"']) == [1.0]


def test_failures_beyond_the_first_ten_are_not_logged(caplog):
    def broken(frame):
        raise OSError("no")

    reward = OcrReward(config(), backend=broken)
    with caplog.at_level(logging.WARNING, logger="miles_rewards.ocr"):
        assert reward([BLANK] * 12, ['"x"'] * 12) == [0.0] * 12
    assert reward.failures == 12
    assert len(caplog.records) == 10 and "further failures are not logged" in caplog.records[-1].getMessage()
    assert reward.pop_metrics() == {"recognizer_failures": 12.0}  # counted past the logging cap


def test_failures_are_counted_for_the_rollout_metric_and_each_pop_resets_the_count():
    def fails_on_black(frame):
        if frame.max() == 0:
            raise RuntimeError("unreadable")
        return "abc"

    black, white = torch.zeros(3, 8, 8), torch.ones(3, 8, 8)
    reward = OcrReward(config(), backend=fails_on_black)
    assert reward.pop_metrics() == {"recognizer_failures": 0.0}  # reported even when nothing failed
    # Two failing images, and a video whose read frames 0, 4, 8 include two black ones
    # (the black frames 1-3 are never read, so they are not failures).
    video = torch.stack([black, black, black, black, white, white, white, white, black], dim=1)
    assert reward([black, white, black, video], ['"abc"'] * 4) == [0.0, 1.0, 0.0, 1.0]
    assert reward.pop_metrics() == {"recognizer_failures": 4.0}
    assert reward.pop_metrics() == {"recognizer_failures": 0.0}  # reset by the pop
    reward([black, white], ['"abc"'] * 2)
    reward([black], ['"abc"'])
    assert reward.pop_metrics() == {"recognizer_failures": 2.0}  # every call since the last pop
    assert reward.failures == 6  # the lifetime count (for the logging cap) is not reset


@pytest.mark.exercises("--ocr-num-workers")
def test_failure_count_is_exact_with_worker_threads_and_concurrent_pops():
    def fails_on_odd(frame):
        if frame[0, 0, 0] % 2:
            raise RuntimeError("unreadable")
        return "abc"

    images = [torch.full((3, 4, 4), i, dtype=torch.uint8) for i in range(256)] * 2
    failing = 256  # the odd pixel values, twice
    reward = OcrReward(config(ocr_num_workers=8), backend=fails_on_odd)
    popped, nonzero_pops, done = [0.0], [0], threading.Event()

    def pop_while_scoring():
        while not done.is_set():
            count = reward.pop_metrics()["recognizer_failures"]
            popped[0] += count
            nonzero_pops[0] += count > 0
            time.sleep(0.0002)

    popper = threading.Thread(target=pop_while_scoring)
    popper.start()
    try:
        for _ in range(3):
            reward(images, ['"abc"'] * len(images))
    finally:
        done.set()
        popper.join()
    assert nonzero_pops[0] >= 1  # some pops did land while the workers were failing
    assert popped[0] + reward.pop_metrics()["recognizer_failures"] == 3 * failing == reward.failures
    reward.close()


# --- --ocr-num-workers ---------------------------------------------------------------


@pytest.mark.exercises("--ocr-num-workers")
def test_workers_change_nothing_in_the_values_and_keep_the_order():
    texts = ["Hello World", "Helo World", "", "Open Sesame", "Opn Sesame", "Miles Core"]
    images = [render(t) if t else BLANK for t in texts]
    prompts = [f'"{t or "Anything"}"' if i % 2 == 0 else '"Hello World"' for i, t in enumerate(texts)]
    video = torch.stack([images[0], BLANK, BLANK, BLANK, images[1]], dim=1)
    outputs, prompts = [*images, video], [*prompts, '"Hello World"']
    serial = OcrReward(config(ocr_num_workers=1))(outputs, prompts)
    parallel = OcrReward(config(ocr_num_workers=3))(outputs, prompts)
    assert parallel == serial
    assert len(set(serial)) >= 4  # the values differ, so a reordering would show


@pytest.mark.exercises("--ocr-num-workers")
def test_workers_run_the_recogniser_on_that_many_threads():
    threads, lock = set(), threading.Lock()
    # Four recogniser calls must be in flight at once to pass the barrier (a timing-free
    # proof of four workers; a pool that reused threads would time out instead).
    together = threading.Barrier(4, timeout=30)

    def concurrent(frame):
        with lock:
            threads.add(threading.current_thread().name)
        together.wait()
        return "abc" if frame[0, 0, 0] == 0 else ""

    images = [torch.zeros(3, 8, 8) if i % 2 else torch.ones(3, 8, 8) for i in range(8)]
    reward = OcrReward(config(ocr_num_workers=4), backend=concurrent)
    assert reward(images, ['"abc"'] * 8) == [0.0, 1.0] * 4
    assert len(threads) == 4 and all(name.startswith("miles-ocr") for name in threads)
    threads.clear()

    def plain(frame):
        with lock:
            threads.add(threading.current_thread().name)
        return "abc" if frame[0, 0, 0] == 0 else ""

    assert OcrReward(config(ocr_num_workers=1), backend=plain)(images, ['"abc"'] * 8) == [0.0, 1.0] * 4
    assert threads == {threading.current_thread().name}


@pytest.mark.exercises("--ocr-num-workers")
def test_workers_flag_resolves_and_is_validated():
    from miles_core.config.resolve import resolve_config
    from miles_core.errors import ConfigError

    assert resolve_config([*BASE, "--rm-type", "ocr"]).ocr_num_workers == 4
    assert resolve_config([*BASE, "--rm-type", "ocr", "--ocr-num-workers", "2"]).ocr_num_workers == 2
    with pytest.raises(ConfigError, match="--ocr-num-workers 0: must be at least 1"):
        resolve_config([*BASE, "--rm-type", "ocr", "--ocr-num-workers", "0"])


# --- --ocr-backend and missing installations --------------------------------------------


@pytest.mark.exercises("--ocr-backend")
def test_backend_flag_defaults_to_tesseract_and_lists_the_choices():
    from miles_core.config.resolve import resolve_config

    config_ = resolve_config([*BASE, "--rm-type", "ocr"])
    assert config_.ocr_backend == "tesseract"
    assert isinstance(OcrReward(config_).backend, ocr.TesseractBackend)
    with pytest.raises(SystemExit):
        resolve_config([*BASE, "--rm-type", "ocr", "--ocr-backend", "nonsense"])


@pytest.mark.exercises("--ocr-backend")
@pytest.mark.parametrize(
    "backend, modules, expected",
    [
        ("easyocr", ("easyocr", "easyocr_en_models"), "miles-rewards[easyocr]"),
        ("paddleocr", ("paddleocr",), "miles-rewards[paddleocr]"),
    ],
)
def test_a_backend_that_is_not_installed_is_a_one_line_error(backend, modules, expected, monkeypatch):
    from miles_core.config.resolve import resolve_config
    from miles_core.errors import ConfigError

    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)  # import fails, find_spec gives None
    with pytest.raises(OcrUnavailableError) as error:
        OcrReward(config(ocr_backend=backend))
    assert expected in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(ConfigError) as config_error:
        resolve_config([*BASE, "--rm-type", "ocr", "--ocr-backend", backend])
    (message,) = config_error.value.messages
    assert f"--ocr-backend {backend} needs" in message and expected in message
    # Not selected: no check.
    resolve_config([*BASE, "--rm-type", "brightness", "--ocr-backend", backend])


@pytest.mark.exercises("--ocr-backend")
def test_missing_tesseract_stops_a_run_with_one_line_naming_what_to_install(monkeypatch, capsys):
    from miles_core.cli.main import main
    from miles_core.config.resolve import resolve_config
    from miles_core.errors import ConfigError
    from miles_rewards.plugin import OCR_MISSING

    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(OcrUnavailableError) as error:
        OcrReward(config())
    assert str(error.value) == OCR_MISSING["tesseract"]
    # Also when ocr is only part of a mixture; not when it is not used at all.
    with pytest.raises(ConfigError) as config_error:
        resolve_config([*BASE, "--reward-weights", '{"ocr": 0.5, "brightness": 0.5}'])
    assert config_error.value.messages == [OCR_MISSING["tesseract"]]
    resolve_config([*BASE, "--rm-type", "brightness"])
    assert main(["train", *BASE, "--rm-type", "ocr", "--output-dir", "/nonexistent/never-written"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "needs the Tesseract binary" in lines[0] and "tesseract-ocr" in lines[0]
    assert "scripts/install.sh" in lines[0]


def test_tesseract_processes_get_one_openmp_thread_unless_the_user_says_otherwise(monkeypatch):
    import os

    import pytesseract

    OcrReward(config())
    environ = pytesseract.pytesseract.environ
    assert environ["OMP_THREAD_LIMIT"] == "1" or "OMP_THREAD_LIMIT" in os.environ
    monkeypatch.setenv("OMP_THREAD_LIMIT", "3")
    assert environ["OMP_THREAD_LIMIT"] == "3"  # a live view of os.environ
    monkeypatch.setenv("MILES_OCR_TEST", "x")
    assert environ["MILES_OCR_TEST"] == "x"


def test_registered_with_its_flags():
    from miles_core.plugin_manager import get_host

    registration = get_host().registries.reward.get("ocr")
    assert registration.spec.ref == "miles_rewards.ocr:OcrReward"
    assert registration.load() is OcrReward


@pytest.mark.exercises("--ocr-backend")
def test_easyocr_backend_reads_rendered_text_when_installed():
    """The optional EasyOCR backend on its offline weights. It needs a torchvision built for
    the installed torch, which this project's CPU environment cannot install, so it runs
    only where `miles-rewards[easyocr]` imports (verified with the real weights)."""
    try:
        import easyocr  # noqa: F401
        import easyocr_en_models  # noqa: F401
    except Exception as exc:  # not installed, or torchvision failing beside torch
        pytest.skip(f"easyocr is not usable here ({type(exc).__name__})")
    reward = OcrReward(config(ocr_backend="easyocr", ocr_num_workers=2))
    images = [render("Hello World"), render("Helo World"), BLANK]
    assert reward(images, ['"Hello World"'] * 3) == [1.0, pytest.approx(0.9, abs=1e-12), 0.0]


def test_through_the_core_scorer_a_prompt_without_quotes_is_a_masked_failed_sample():
    import asyncio

    from miles_core.config.resolve import resolve_config
    from miles_core.training.rewards import RewardScorer

    scorer = RewardScorer(resolve_config([*BASE, "--rm-type", "ocr", "--ocr-num-workers", "2"]))
    outputs = [render("Hello World"), render("Helo World"), BLANK, render("Hello World")]
    prompts = ['"Hello World"', '"Hello World"', '"Hello World"', "no quotes"]
    samples = [
        SimpleNamespace(
            pixels=o,
            prompt=p,
            metadata={},
            seed=i,
            group_index=i // 2,
            index_in_group=i % 2,
            reward=None,
            reward_components={},
            reward_failed=False,
            remove_sample=False,
        )
        for i, (o, p) in enumerate(zip(outputs, prompts))
    ]
    values = asyncio.run(scorer.score(samples)).tolist()
    assert values[:3] == [1.0, pytest.approx(0.9, abs=1e-6), 0.0] and math.isnan(values[3])
    assert [s.reward_failed for s in samples] == [False, False, False, True]
    assert samples[3].remove_sample
