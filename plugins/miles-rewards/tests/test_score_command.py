"""``miles-core score`` with this plugin's model, judge and video rewards: the command
prints, for image files, what the registered reward computes on the same pixels."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from miles_core.cli.main import main
from miles_core.cli.score import load_pixels

from ._chat_server import ChatServer
from ._clip_tiny import build_reward, save_tiny_clip
from ._hps_tiny import save_checkpoint as save_hps_checkpoint
from ._hps_tiny import tiny_state as hps_state
from ._imagereward_tiny import save_checkpoint as save_imagereward_checkpoint
from ._imagereward_tiny import save_tokenizer
from ._imagereward_tiny import tiny_state as imagereward_state


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Two RGB images and a 4-frame animated GIF (scored as a video)."""
    root = tmp_path_factory.mktemp("score")
    generator = np.random.default_rng(5)
    images = []
    for name in ("a", "b"):
        path = root / f"{name}.png"
        Image.fromarray(generator.integers(0, 256, (20, 24, 3), dtype=np.uint8)).save(path)
        images.append(path)
    frames = [Image.fromarray(np.full((16, 16, 3), 40 * i + 20, dtype=np.uint8)) for i in range(4)]
    gif = root / "clip.gif"
    frames[0].save(gif, save_all=True, append_images=frames[1:], duration=100, loop=0)
    return {"images": images, "gif": gif}


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """Tiny random weights of each model reward, in their original layouts."""
    from transformers import AutoTokenizer

    from miles_core.tiny.tokenizers import clip_tokenizer

    root = tmp_path_factory.mktemp("weights")
    clip = save_tiny_clip(root / "clip", seed=3)
    tokenizer = clip_tokenizer()
    tokenizer.save_pretrained(root / "hps-tokenizer")
    hps = save_hps_checkpoint(root / "HPS_v2.1_compressed.pt", hps_state(len(tokenizer)))
    save_tokenizer(root / "bert")
    bert = AutoTokenizer.from_pretrained(root / "bert")
    bert.add_special_tokens({"bos_token": "[DEC]"})
    bert.add_special_tokens({"additional_special_tokens": ["[ENC]"]})
    imagereward = save_imagereward_checkpoint(root / "ImageReward.pt", imagereward_state(len(bert)))
    return {
        "clipscore": ("--clipscore-model-path", str(clip)),
        "temporal_consistency": ("--clipscore-model-path", str(clip)),
        "motion_magnitude": (),
        "hpsv2": ("--hpsv2-checkpoint-path", str(hps), "--hpsv2-tokenizer-path", str(root / "hps-tokenizer")),
        "imagereward": ("--imagereward-checkpoint-path", str(imagereward), "--imagereward-tokenizer-path", str(root / "bert")),
    }


def printed(capsys, *argv: str) -> list[float]:
    assert main(["score", *argv, "--json"]) == 0, capsys.readouterr().err
    return [json.loads(line)["reward"] for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


def direct(name: str, flags, paths, prompt: str) -> list[float]:
    reward = build_reward(name, *flags)
    return [float(value) for value in reward([load_pixels(path) for path in paths], [prompt] * len(paths), [{}] * len(paths))]


@pytest.mark.parametrize("name", ["clipscore", "hpsv2", "imagereward"])
def test_model_rewards(capsys, files, weights, name):
    got = printed(capsys, "--rm-type", name, *weights[name], "--prompt", "a red cube", *map(str, files["images"]))
    assert got == pytest.approx(direct(name, weights[name], files["images"], "a red cube"), rel=1e-6, abs=1e-7)
    assert got[0] != got[1]


@pytest.mark.parametrize("name", ["temporal_consistency", "motion_magnitude"])
def test_video_rewards_on_an_animated_gif(capsys, files, weights, name):
    got = printed(capsys, "--rm-type", name, *weights[name], "--prompt", "a fade", str(files["gif"]))
    assert got == pytest.approx(direct(name, weights[name], [files["gif"]], "a fade"), rel=1e-6, abs=1e-7)
    if name == "motion_magnitude":  # frames 20, 60, 100, 140: each step 40 / 255
        assert got == [pytest.approx(40 / 255)]


def test_vlm_judge_through_a_chat_server(capsys, files):
    with ChatServer() as server:
        flags = ("--vlm-url", server.url, "--vlm-model", server.model)
        got = printed(capsys, "--rm-type", "vlm_judge", *flags, "--prompt", "a red cube", *map(str, files["images"]))
        for value, path in zip(got, files["images"]):
            brightness = np.asarray(Image.open(path).convert("RGB"), dtype=np.float64).mean() / 255.0
            assert value == pytest.approx(round(10 * brightness, 3) / 10, abs=1e-12)  # the server's rule, / (HI - LO)
        assert len(server.received) == 2
    # Nobody answers now: the sample fails (a warning and the failed line), the command does not stop.
    assert main(["score", "--rm-type", "vlm_judge", *flags, "--rm-max-retries", "0", "--prompt", "p", str(files["images"][0])]) == 0
    captured = capsys.readouterr()
    assert "failed" in captured.out and "vlm_judge" in captured.err
