"""``miles-core generate``: files and manifest, determinism for a seed, refusal to
overwrite, prompt files, LoRA loading, one-line errors with exit status 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from miles_core.cli import generate
from miles_core.errors import UsageError
from miles_sd3.family import SD3Family

torch.set_num_threads(1)

COMMON = [
    "--diffusion-model-family",
    "sd3",
    "--height",
    "32",
    "--width",
    "32",
    "--num-inference-steps",
    "3",
    "--guidance-scale",
    "4.5",
    "--seed",
    "7",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return SD3Family.build_tiny_pipeline(tmp_path_factory.mktemp("sd3") / "tiny")


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "miles_core.cli.main", "generate", *args], capture_output=True, text=True, env=env, check=False
    )


def pixels(path: Path) -> np.ndarray:
    with Image.open(path) as image:
        return np.asarray(image.convert("RGB"))


def manifest(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "manifest.jsonl").read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def one_prompt(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("one") / "out"
    result = cli("--hf-checkpoint", str(tiny), *COMMON, "--prompt", "a red cube", "--num-outputs", "2", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "wrote 2 file(s)" in result.stderr
    return out


def test_a_prompt_writes_pngs_and_a_manifest(one_prompt: Path) -> None:
    assert sorted(p.name for p in one_prompt.iterdir()) == ["manifest.jsonl", "p000_s7.png", "p000_s8.png"]
    assert manifest(one_prompt) == [
        {"prompt_index": 0, "prompt": "a red cube", "seed": 7, "file": "p000_s7.png"},
        {"prompt_index": 0, "prompt": "a red cube", "seed": 8, "file": "p000_s8.png"},
    ]
    first, second = pixels(one_prompt / "p000_s7.png"), pixels(one_prompt / "p000_s8.png")
    assert first.shape == (32, 32, 3) and first.dtype == np.uint8
    assert not np.array_equal(first, second)  # output i has its own seed


def test_a_prompt_file_and_determinism_for_a_seed(tiny: Path, one_prompt: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"text": "a red cube", "metadata": {"id": "a"}}\n\n{"text": "a blue sphere"}\n', encoding="utf-8")
    out = tmp_path / "out"
    result = cli(
        "--hf-checkpoint", str(tiny), *COMMON, "--prompt-file", str(prompts), "--input-key", "text", "--num-outputs", "2", "--out", str(out)
    )
    assert result.returncode == 0, result.stderr
    rows = manifest(out)
    assert [(r["prompt_index"], r["prompt"], r["seed"], r["file"]) for r in rows] == [
        (0, "a red cube", 7, "p000_s7.png"),
        (0, "a red cube", 8, "p000_s8.png"),
        (1, "a blue sphere", 7, "p001_s7.png"),
        (1, "a blue sphere", 8, "p001_s8.png"),
    ]
    assert rows[0]["metadata"] == {"id": "a"} and "metadata" not in rows[2]
    # Same prompt and seed in another process: the same image, bit for bit.
    for name in ("p000_s7.png", "p000_s8.png"):
        assert np.array_equal(pixels(out / name), pixels(one_prompt / name))
    # Control: another prompt with the same seed differs.
    assert not np.array_equal(pixels(out / "p001_s7.png"), pixels(out / "p000_s7.png"))


def test_never_overwrites(tiny: Path, one_prompt: Path) -> None:
    before = {p.name: p.read_bytes() for p in one_prompt.iterdir()}
    # Seeds 6, 7: 7 exists, so nothing is generated (6 is not written either).
    with pytest.raises(SystemExit) as info:
        generate.run(
            ["--hf-checkpoint", str(tiny), *COMMON, "--seed", "6", "--num-outputs", "2", "--prompt", "a red cube", "--out", str(one_prompt)]
        )
    assert info.value.code == 2
    assert {p.name: p.read_bytes() for p in one_prompt.iterdir()} == before


def test_never_overwrites_message(tiny: Path, one_prompt: Path) -> None:
    result = cli("--hf-checkpoint", str(tiny), *COMMON, "--prompt", "x", "--out", str(one_prompt))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "p000_s7.png exists; refusing to overwrite it" in lines[0]


def write_lora(tiny: Path, out: Path) -> Path:
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline
    from peft import LoraConfig, get_peft_model_state_dict

    transformer = SD3Transformer2DModel.from_pretrained(tiny / "transformer")
    torch.manual_seed(0)
    # init_lora_weights=False: random A and B, so the adapter changes the output.
    transformer.add_adapter(
        LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0"])
    )
    StableDiffusion3Pipeline.save_lora_weights(out, transformer_lora_layers=get_peft_model_state_dict(transformer))
    return out


def test_lora_changes_the_image(tiny: Path, one_prompt: Path, tmp_path: Path) -> None:
    lora = write_lora(tiny, tmp_path / "lora")
    args = ["--hf-checkpoint", str(tiny), *COMMON, "--prompt", "a red cube"]
    assert generate.run([*args, "--lora", str(lora), "--out", str(tmp_path / "with")]) == 0
    # Two outputs, as one_prompt has: the same batch shapes, so the same kernels and rounding.
    assert generate.run([*args, "--num-outputs", "2", "--out", str(tmp_path / "without")]) == 0
    base = pixels(one_prompt / "p000_s7.png")
    with_lora = pixels(tmp_path / "with" / "p000_s7.png")
    assert not np.array_equal(with_lora, base)
    print(f"LoRA: max |with - base| = {np.abs(with_lora.astype(int) - base.astype(int)).max()} / 255")
    # The same command without --lora gives the base image, bit for bit (in this process).
    assert np.array_equal(pixels(tmp_path / "without" / "p000_s7.png"), base)


def run_error(argv: list[str], capsys: pytest.CaptureFixture) -> str:
    with pytest.raises(SystemExit) as info:
        generate.run(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_errors_are_one_line_and_write_nothing(tiny: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    out = tmp_path / "out"
    base = ["--hf-checkpoint", str(tiny), "--diffusion-model-family", "sd3", "--out", str(out)]
    assert "one of the arguments --prompt --prompt-file is required" in run_error(base, capsys)
    assert "not allowed with" in run_error([*base, "--prompt", "x", "--prompt-file", "p.txt"], capsys)
    assert "expected a .jsonl or .txt file" in run_error([*base, "--prompt-file", str(tmp_path / "p.csv")], capsys)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input": "ok"}\n{"input": ""}\n', encoding="utf-8")
    assert f"{bad}:2" in run_error([*base, "--prompt-file", str(bad)], capsys)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n", encoding="utf-8")
    assert "no prompts" in run_error([*base, "--prompt-file", str(empty)], capsys)
    assert "--num-outputs 0" in run_error([*base, "--prompt", "x", "--num-outputs", "0"], capsys)
    assert "no such file" in run_error([*base, "--prompt", "x", "--lora", str(tmp_path / "nope")], capsys)
    (tmp_path / "plain").mkdir()  # a directory that is no diffusers pipeline: no family to read from it
    assert "--diffusion-model-family" in run_error(["--hf-checkpoint", str(tmp_path / "plain"), "--prompt", "x", "--out", str(out)], capsys)
    assert f"--hf-checkpoint {tmp_path / 'absent'}: no such directory" in run_error(
        ["--hf-checkpoint", str(tmp_path / "absent"), "--prompt", "x", "--out", str(out)], capsys
    )
    assert "--height 50 must be a multiple of 16" in run_error([*base, "--prompt", "x", "--height", "50"], capsys)
    # A family whose pipeline has no LoRA loader.
    monkeypatch.setattr(SD3Family, "pipeline_class", "diffusers:DiffusionPipeline")
    lora_dir = tmp_path / "lora"
    lora_dir.mkdir()
    assert "has no LoRA loader" in run_error([*base, "--prompt", "x", "--lora", str(lora_dir)], capsys)
    assert not out.exists()


def test_a_txt_prompt_file(tiny: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cube\n\n  a blue sphere  \n", encoding="utf-8")
    out = tmp_path / "out"
    assert (
        generate.run(
            ["--hf-checkpoint", str(tiny), *COMMON, "--num-inference-steps", "2", "--prompt-file", str(prompts), "--out", str(out)]
        )
        == 0
    )
    assert [(r["prompt"], r["file"]) for r in manifest(out)] == [("a red cube", "p000_s7.png"), ("a blue sphere", "p001_s7.png")]


def test_video_outputs_are_mp4(tmp_path: Path) -> None:
    import imageio.v3 as iio

    assert generate.mp4_encoder() is not None, "imageio with imageio-ffmpeg (the video extra) is not installed"
    video = torch.rand(3, 5, 16, 24)
    name = generate.write_output(tmp_path, 2, 11, video, fps=10)
    assert name == "p002_s11.mp4"
    frames = iio.imread(tmp_path / name, plugin="FFMPEG", index=None)
    assert frames.shape == (5, 16, 24, 3) and frames.dtype == np.uint8
    assert iio.immeta(tmp_path / name, plugin="FFMPEG")["fps"] == 10.0
    with pytest.raises(UsageError, match="exists"):
        generate.write_output(tmp_path, 2, 11, video, fps=10)
    # A flat grey video comes back grey (H.264 is lossy, not arbitrary).
    grey = generate.write_output(tmp_path, 0, 0, torch.full((3, 2, 16, 16), 0.5), fps=None)
    assert np.abs(iio.imread(tmp_path / grey, plugin="FFMPEG", index=None).astype(int) - 128).max() <= 2


def test_video_outputs_fall_back_to_animated_gifs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)  # the encoder is not installed
    assert generate.mp4_encoder() is None
    video = torch.rand(3, 5, 8, 8)
    name = generate.write_output(tmp_path, 2, 11, video, fps=10)
    assert name == "p002_s11.gif"
    with Image.open(tmp_path / name) as gif:
        assert gif.n_frames == 5 and gif.size == (8, 8) and gif.info["duration"] == 100
    with pytest.raises(UsageError, match="exists"):
        generate.write_output(tmp_path, 2, 11, video, fps=10)


def as_video(monkeypatch: pytest.MonkeyPatch, frames: int = 3) -> None:
    """Make the engine return videos: each SD3 image as ``frames`` frames, darker each frame
    (identical frames would merge in a GIF)."""
    from miles_core.engine.embedded import EmbeddedEngine

    original = EmbeddedEngine.generate_sync

    def generate_sync(self, request):
        outputs = original(self, request)
        for output in outputs:
            fade = torch.linspace(1.0, 0.5, frames).reshape(1, frames, 1, 1)
            output.generated_output = output.generated_output.unsqueeze(1) * fade
        return outputs

    monkeypatch.setattr(EmbeddedEngine, "generate_sync", generate_sync)


def test_a_video_run_writes_mp4s_in_the_manifest(tiny: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    import imageio.v3 as iio

    as_video(monkeypatch)
    out = tmp_path / "out"
    assert (
        generate.run(
            ["--hf-checkpoint", str(tiny), *COMMON, "--prompt", "a red cube", "--num-outputs", "2", "--fps", "8", "--out", str(out)]
        )
        == 0
    )
    assert [r["file"] for r in manifest(out)] == ["p000_s7.mp4", "p000_s8.mp4"]
    assert sorted(p.name for p in out.iterdir()) == ["manifest.jsonl", "p000_s7.mp4", "p000_s8.mp4"]
    assert iio.imread(out / "p000_s7.mp4", plugin="FFMPEG", index=None).shape == (3, 32, 32, 3)
    assert "note" not in capsys.readouterr().err
    # The MP4 counts as an existing output: a second run refuses to overwrite it.
    with pytest.raises(SystemExit):
        generate.run(["--hf-checkpoint", str(tiny), *COMMON, "--prompt", "a red cube", "--out", str(out)])
    assert "p000_s7.mp4 exists" in capsys.readouterr().err


def test_a_video_run_without_an_encoder_writes_gifs_with_a_note(tiny: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    as_video(monkeypatch)
    monkeypatch.setitem(sys.modules, "imageio", None)
    out = tmp_path / "out"
    assert generate.run(["--hf-checkpoint", str(tiny), *COMMON, "--prompt", "a red cube", "--num-outputs", "2", "--out", str(out)]) == 0
    assert [r["file"] for r in manifest(out)] == ["p000_s7.gif", "p000_s8.gif"]
    with Image.open(out / "p000_s7.gif") as gif:
        assert gif.n_frames == 3 and gif.size == (32, 32)
    notes = [line for line in capsys.readouterr().err.splitlines() if "note:" in line]
    assert notes == [f"miles-core generate: note: {generate.GIF_NOTE}"]
    assert "pip install -c constraints.txt -e '.[video]'" in notes[0]


def test_flow_shift_and_the_family_guidance_options(tiny: Path, one_prompt: Path, tmp_path: Path, capsys) -> None:
    # --flow-shift reaches the schedule: other pixels than the checkpoint's own shift (3).
    out = tmp_path / "shifted"
    assert (
        generate.run(
            [
                "--hf-checkpoint",
                str(tiny),
                *COMMON,
                "--prompt",
                "a red cube",
                "--num-outputs",
                "2",
                "--flow-shift",
                "1.0",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert not np.array_equal(pixels(out / "p000_s7.png"), pixels(one_prompt / "p000_s7.png"))
    same = tmp_path / "same"
    assert (
        generate.run(
            [
                "--hf-checkpoint",
                str(tiny),
                *COMMON,
                "--prompt",
                "a red cube",
                "--num-outputs",
                "2",
                "--flow-shift",
                "3.0",
                "--out",
                str(same),
            ]
        )
        == 0
    )
    assert np.array_equal(pixels(same / "p000_s7.png"), pixels(one_prompt / "p000_s7.png"))  # control
    capsys.readouterr()
    # Options a family does not have are refused by it, naming the flag.
    err = run_error(["--hf-checkpoint", str(tiny), *COMMON, "--prompt", "p", "--true-cfg-scale", "4", "--out", str(tmp_path / "x")], capsys)
    assert err.startswith("miles-core generate: error: --true-cfg-scale SD3 has no true CFG")


class RequiredImageSD3(SD3Family):
    """SD3 declared image-to-video with a required image (SD3 encodes none: only the
    command's checks and its manifest read the attribute)."""

    image_input = "required"


@pytest.fixture
def image_family():
    """The tiny SD3 pipeline's family registered for a while as one that requires an
    image (the image-to-video families' own tests run the real thing)."""
    from dataclasses import replace

    from miles_core.plugin_manager import get_host
    from miles_core.registry import Registration

    registry = get_host().registries.model_family
    sd3 = registry.get("sd3")
    spec = replace(sd3.spec, name="sd3_image_test", ref=f"{__name__}:RequiredImageSD3", image_input="required", pipeline_classes=())
    registry.add(Registration(spec, sd3.plugin))
    yield spec.name
    registry.discard(spec.name)


def test_image_flags_are_checked_before_the_model_loads(tiny: Path, tmp_path: Path, capsys, image_family: str) -> None:
    from miles_core.family_checks import write_conditioning_image

    image = write_conditioning_image(tmp_path / "first.png", height=32, width=32)
    out = tmp_path / "out"
    text = ["--hf-checkpoint", str(tiny), "--diffusion-model-family", "sd3", "--prompt", "x", "--out", str(out)]
    assert run_error([*text, "--image", str(image)], capsys).endswith(
        f"error: --image {image}: the sd3 family takes no conditioning image (it is text-to-image/video)"
    )
    base = ["--hf-checkpoint", str(tiny), "--diffusion-model-family", image_family, "--out", str(out)]
    assert run_error([*base, "--prompt", "x"], capsys).endswith(
        f"error: --image: the {image_family} family is image-to-video and needs a conditioning image (give --image PATH)"
    )
    assert run_error([*base, "--prompt", "x", "--image", str(tmp_path / "nope.png")], capsys).endswith(
        f"error: --image {tmp_path / 'nope.png'}: no such image file"
    )
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"input": "a", "image": "first.png"}\n{"input": "b"}\n', encoding="utf-8")
    assert run_error([*base, "--prompt-file", str(rows)], capsys).endswith(
        f"error: --prompt-file {rows}:2: no 'image' key: the {image_family} family is image-to-video (set --image-key to the image's key)"
    )
    assert not out.exists()


@pytest.mark.exercises("--image-key")
def test_images_reach_the_manifest(tiny: Path, tmp_path: Path, image_family: str) -> None:
    from miles_core.family_checks import write_conditioning_image

    first = write_conditioning_image(tmp_path / "images" / "first.png", height=32, width=32)
    second = write_conditioning_image(tmp_path / "second.png", height=32, width=32, seed=1)
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"input": "a", "picture": "images/first.png"}\n{"input": "b", "picture": "second.png"}\n', encoding="utf-8")
    args = ["--hf-checkpoint", str(tiny), "--diffusion-model-family", image_family, "--height", "32", "--width", "32"]
    args += ["--num-inference-steps", "1", "--guidance-scale", "1", "--prompt-file", str(rows)]
    assert generate.run([*args, "--image-key", "picture", "--out", str(tmp_path / "rows")]) == 0
    assert [(r["prompt"], r["image"]) for r in manifest(tmp_path / "rows")] == [("a", str(first)), ("b", str(second))]
    # --image applies to every prompt, whatever the rows say.
    assert generate.run([*args, "--image", str(second), "--out", str(tmp_path / "one")]) == 0
    assert [(r["prompt"], r["image"]) for r in manifest(tmp_path / "one")] == [("a", str(second)), ("b", str(second))]
