"""``miles-core score``: rewards of image files, through the training reward code."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from miles_core.cli.main import main

RED, BLUE = (200, 30, 30), (30, 30, 200)


def redness(rgb) -> float:
    """mean(R - (G + B) / 2) on [0, 1] pixels, the redness reward's formula."""
    r, g, b = (c / 255 for c in rgb)
    return r - (g + b) / 2


@pytest.fixture
def images(tmp_path):
    paths = {}
    for name, rgb in (("red", RED), ("blue", BLUE)):
        paths[name] = tmp_path / f"{name}.png"
        Image.fromarray(np.full((16, 24, 3), rgb, dtype=np.uint8)).save(paths[name])
    return paths


def score(capsys, *argv):
    code = main(["score", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out.strip().splitlines(), err.strip()


@pytest.mark.exercises("--rm-type")
def test_scores_files_with_a_registered_reward(capsys, images):
    code, lines, _ = score(capsys, "--rm-type", "redness", "--prompt", "a red cube", images["red"], images["blue"])
    assert code == 0
    assert lines[0] == f"{images['red']}  {redness(RED):.6f}"
    assert lines[1] == f"{images['blue']}  {redness(BLUE):.6f}"
    assert lines[2] == f"mean  {(redness(RED) + redness(BLUE)) / 2:.6f}  (2 of 2 image(s) scored)"
    # Control: another reward gives other numbers for the same files.
    _, bright, _ = score(capsys, "--rm-type", "brightness", "--prompt", "a red cube", images["red"])
    assert bright[0] != lines[0]


@pytest.mark.exercises("--prompt-data", "--input-key", "--metadata-key")
def test_prompt_data_rows_name_prompts_images_and_a_per_sample_reward(capsys, images, tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"text": "a red cube", "file": "red.png"},
                {"text": "a blue ball", "file": str(images["blue"]), "meta": {"rm_type": "brightness"}},
            ]
        )
        + "\n"
    )
    code, lines, _ = score(
        capsys,
        "--rm-type",
        "redness",
        "--prompt-data",
        rows,
        "--input-key",
        "text",
        "--image-key",
        "file",
        "--metadata-key",
        "meta",
        "--json",
    )
    assert code == 0
    records = [json.loads(line) for line in lines]
    assert [r["prompt"] for r in records] == ["a red cube", "a blue ball"]
    assert records[0]["reward"] == pytest.approx(redness(RED), abs=1e-6)
    assert records[1]["reward"] == pytest.approx(np.mean(BLUE) / 255, abs=1e-6)  # brightness, per metadata.rm_type


@pytest.mark.exercises("--custom-rm-path", "--group-rm", "--reward-key")
def test_custom_group_and_dict_rewards(capsys, images):
    files = [images["red"], images["blue"], images["red"]]
    _, plain, _ = score(capsys, "--custom-rm-path", "tests.score_examples.group_size_rm", "--prompt", "p", *files)
    _, grouped, _ = score(capsys, "--custom-rm-path", "tests.score_examples.group_size_rm", "--group-rm", "--prompt", "p", *files)
    assert [line.split()[1] for line in plain[:3]] == ["3.000000"] * 3  # one batched call
    assert [line.split()[1] for line in grouped[:3]] == ["3.000000"] * 3  # one prompt: one group
    code, keyed, _ = score(
        capsys, "--custom-rm-path", "tests.score_examples.width_rm", "--reward-key", "width", "--prompt", "p", images["red"]
    )
    assert code == 0 and keyed[0].split()[1] == "24.000000" and "height 16.000000" in keyed[0]


def test_bad_input_is_one_line(capsys, images, tmp_path):
    code, _, err = score(capsys, "--rm-type", "redness", "--prompt", "p", tmp_path / "missing.png")
    assert code == 2 and err == f"miles-core score: error: {tmp_path / 'missing.png'}: no such image file"
    code, _, err = score(capsys, "--rm-type", "redness", "--prompt", "p")
    assert code == 2 and err == "miles-core score: error: --prompt needs at least one IMAGE file to score"
    code, _, err = score(capsys, "--rm-type", "no_such_reward", "--prompt", "p", images["red"])
    assert code == 2 and err.startswith("miles-core score: error: ") and "redness" in err  # lists the installed
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input": "p", "image": "red.png"}\nnot json\n')
    code, _, err = score(capsys, "--rm-type", "redness", "--prompt-data", bad)
    assert code == 2 and err == f"miles-core score: error: --prompt-data {bad}:2: not JSON (Expecting value)"
    text = tmp_path / "note.png"
    text.write_text("not an image")
    code, _, err = score(capsys, "--rm-type", "redness", "--prompt", "p", text)
    assert code == 2 and err.startswith(f"miles-core score: error: {text}: not an image Pillow can read")


@pytest.mark.exercises("--reward-weights")
def test_a_mixture_prints_its_components_and_a_failed_sample_says_so(capsys, images, tmp_path):
    code, lines, _ = score(capsys, "--reward-weights", '{"redness": 0.5, "brightness": 2.0}', "--prompt", "p", images["red"])
    bright = np.mean(RED) / 255
    assert code == 0
    assert lines[0] == (f"{images['red']}  {0.5 * redness(RED) + 2.0 * bright:.6f}  redness {redness(RED):.6f}  brightness {bright:.6f}")
    code, lines, err = score(
        capsys, "--custom-rm-path", "tests.reward_examples.fails_first_sample", "--prompt", "p", images["red"], images["blue"]
    )
    assert code == 0 and lines[0] == f"{images['red']}  failed" and "1 of 2 image(s) scored" in lines[2]


def test_an_animated_gif_is_scored_as_a_video(capsys, tmp_path):
    frames = [Image.fromarray(np.full((8, 8, 3), rgb, dtype=np.uint8)) for rgb in (RED, BLUE, RED)]
    gif = tmp_path / "clip.gif"
    frames[0].save(gif, save_all=True, append_images=frames[1:], duration=100)
    code, lines, _ = score(capsys, "--rm-type", "brightness", "--prompt", "p", gif)
    # brightness of a video: the mean over its frames (GIF palettes keep these flat colours exact)
    assert code == 0 and lines[0] == f"{gif}  {np.mean([np.mean(RED), np.mean(BLUE), np.mean(RED)]) / 255:.6f}"


def test_a_reward_that_fails_on_every_image_is_a_warning_not_a_stop(capsys, images):
    code, lines, err = score(capsys, "--custom-rm-path", "tests.reward_examples.always_fails", "--prompt", "p", images["red"])
    assert code == 0 and lines == [f"{images['red']}  failed"]
    assert err.splitlines()[-1].startswith("miles-core score: warning: reward ")
