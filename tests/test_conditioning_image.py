"""Image-to-video plumbing in the core, on the tiny SD3 pipeline (a text-to-image family)
and :class:`RequiredImageSD3` (the same family declared image-to-video, which only the
core's checks read): the request field on the wire, the conditioning image's hash and
pixels, the family's ``image_input`` checked by the engine, the server, the registry,
the configuration, prompt rows and ``miles-core generate``, and micro-batches that never
mix conditionings. End-to-end image-to-video runs in the miles-wan22 plugin's tests."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from miles_core.conditioning_image import ConditioningImage, check_request_image, load_conditioning_image, request_image
from miles_core.config.resolve import family_image_input, resolve_config, training_errors
from miles_core.engine.prompt_store import conditioning_key
from miles_core.errors import ComponentLoadError, PromptDataError, RequestError
from miles_core.family import Conditioning, GenerationParams
from miles_core.family_checks import tiny_train_args, write_conditioning_image
from miles_core.plugin_manager import get_host
from miles_core.registry import Registration
from miles_core.request import RolloutRequest
from miles_core.rollout.data import load_prompts, run_image_options
from miles_core.rollout.evaluation import eval_requests
from miles_core.rollout.generate import RolloutSettings
from miles_core.rollout.seeds import Microgroup
from miles_core.training.pairs import TrainPair, micro_batches
from miles_sd3.family import SD3Family


class RequiredImageSD3(SD3Family):
    """SD3 declared image-to-video with a required image. It encodes no image (SD3 has no
    image conditioning): the tests below use it only where the core's checks run."""

    image_input = "required"


class OptionalImageSD3(SD3Family):
    """SD3 declared with an optional image (as TI2V-5B): only the core's checks read it."""

    image_input = "optional"


CUSTOM = ("--train-pipeline-config-path", f"{__name__}.RequiredImageSD3")
OPTIONAL = ("--train-pipeline-config-path", f"{__name__}.OptionalImageSD3")


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("images")
    return {
        "a": write_conditioning_image(folder / "a.png", height=32, width=48, seed=0),
        "b": write_conditioning_image(folder / "b.png", height=32, width=48, seed=1),
    }


# -- the image file --------------------------------------------------------------------------------


def test_write_conditioning_image_is_a_seeded_smooth_rgb_png(tmp_path, images):
    again = write_conditioning_image(tmp_path / "sub" / "a.png", height=32, width=48, seed=0)
    assert again.read_bytes() == images["a"].read_bytes()
    assert images["b"].read_bytes() != images["a"].read_bytes()  # control: another seed, another image
    with Image.open(images["a"]) as opened:
        assert (opened.format, opened.mode, opened.size) == ("PNG", "RGB", (48, 32))
        pixels = np.asarray(opened).astype(int)
    # Smooth: neighbouring pixels differ by a few levels, the image as a whole by much more.
    assert np.abs(np.diff(pixels, axis=0)).max() <= 40 and np.abs(np.diff(pixels, axis=1)).max() <= 40
    assert (pixels.max(axis=(0, 1)) - pixels.min(axis=(0, 1))).min() > 100


def test_request_image_hashes_the_content_and_load_refuses_a_changed_file(tmp_path, images):
    assert request_image(RolloutRequest(prompt="p")) is None
    image = request_image(RolloutRequest(prompt="p", image_path=(str(images["a"]),)))
    assert image == ConditioningImage(str(images["a"]), hashlib.sha256(images["a"].read_bytes()).hexdigest())
    assert image.sha256 in repr(image)
    pixels = load_conditioning_image(image)
    assert (pixels.mode, pixels.size) == ("RGB", (48, 32))
    assert np.array_equal(np.asarray(pixels), np.asarray(Image.open(images["a"])))
    # The same bytes under another name hash the same; other bytes do not.
    copy = Path(shutil.copy(images["a"], tmp_path / "copy.png"))
    assert request_image(RolloutRequest(prompt="p", image_path=(str(copy),))).sha256 == image.sha256
    assert request_image(RolloutRequest(prompt="p", image_path=(str(images["b"]),))).sha256 != image.sha256
    # A file rewritten after it was hashed is refused, naming the field and the file.
    copy_image = ConditioningImage(str(copy), image.sha256)
    assert load_conditioning_image(copy_image).size == (48, 32)
    shutil.copy(images["b"], copy)
    with pytest.raises(RequestError, match=rf"^image_path: {copy} changed while the request was being served"):
        copy_image.load()
    text = tmp_path / "notes.png"
    text.write_text("not pixels")
    not_image = request_image(RolloutRequest(prompt="p", image_path=(str(text),)))
    with pytest.raises(RequestError, match=rf"^image_path: {text} is not an image PIL can read"):
        load_conditioning_image(not_image)
    with pytest.raises(RequestError, match=r"^image_path: cannot read .*missing\.png"):
        request_image(RolloutRequest(prompt="p", image_path=(str(tmp_path / "missing.png"),)))


def test_cache_keys_change_with_the_image_content(tmp_path, images):
    params = GenerationParams(height=32, width=48, num_inference_steps=2, guidance_scale=1.0)

    def key(path: Path) -> tuple:
        return conditioning_key("p", None, replace(params, image=request_image(RolloutRequest(prompt="p", image_path=(str(path),)))))

    assert key(images["a"]) == key(images["a"])
    assert key(images["a"]) != key(images["b"])
    assert key(images["a"]) != conditioning_key("p", None, params)  # text only
    # Same name, new content: a new key (the name alone would have served stale tensors).
    path = Path(shutil.copy(images["a"], tmp_path / "x.png"))
    before = key(path)
    shutil.copy(images["b"], path)
    assert key(path) != before


def test_an_image_is_turned_upright_by_its_exif_orientation(tmp_path, images):
    """As diffusers.utils.load_image: orientation 6 (rotate 90 degrees clockwise) gives a
    48x32 image from 32x48 pixels; the control without the tag keeps the pixels as stored."""
    from diffusers.utils import load_image

    with Image.open(images["a"]) as opened:
        stored = opened.convert("RGB")
    exif = Image.Exif()
    exif[0x0112] = 6
    rotated = tmp_path / "rotated.png"
    stored.save(rotated, exif=exif)
    upright = load_conditioning_image(request_image(RolloutRequest(prompt="p", image_path=(str(rotated),))))
    assert upright.size == (32, 48)
    assert np.array_equal(np.asarray(upright), np.asarray(stored.transpose(Image.Transpose.ROTATE_270)))
    assert np.array_equal(np.asarray(upright), np.asarray(load_image(str(rotated))))
    plain = load_conditioning_image(request_image(RolloutRequest(prompt="p", image_path=(str(images["a"]),))))
    assert np.array_equal(np.asarray(plain), np.asarray(stored))  # control


def test_hostile_image_paths_are_refused_naming_image_path(tmp_path, images, monkeypatch):
    import os

    from PIL import Image as PILImage

    import miles_core.conditioning_image as conditioning_image

    def read(path: Path) -> ConditioningImage | None:
        return request_image(RolloutRequest(prompt="p", image_path=(str(path),)))

    with pytest.raises(RequestError, match=rf"^image_path: {tmp_path} is not a regular file$"):
        read(tmp_path)  # a directory
    fifo = tmp_path / "pipe.png"
    os.mkfifo(fifo)
    with pytest.raises(RequestError, match=rf"^image_path: {fifo} is not a regular file$"):
        read(fifo)  # returns at once: opening a FIFO without a writer must not block
    size = images["a"].stat().st_size
    monkeypatch.setattr(conditioning_image, "MAX_IMAGE_BYTES", size - 1)
    with pytest.raises(
        RequestError, match=rf"^image_path: {images['a']} holds {size} bytes; a conditioning image may hold at most {size - 1}$"
    ):
        read(images["a"])
    monkeypatch.setattr(conditioning_image, "MAX_IMAGE_BYTES", size)
    image = read(images["a"])  # control: at the cap
    # More pixels than twice PIL's bomb limit: a RequestError, not an exception escaping as a 500.
    monkeypatch.setattr(PILImage, "MAX_IMAGE_PIXELS", 32 * 48 // 4)
    with pytest.raises(RequestError, match=rf"^image_path: {images['a']} is refused as a decompression bomb"):
        image.load()
    monkeypatch.setattr(PILImage, "MAX_IMAGE_PIXELS", 32 * 48)
    assert image.load().size == (48, 32)  # control


# -- the request -----------------------------------------------------------------------------------


def test_image_path_travels_as_a_list_and_takes_one_image():
    base = RolloutRequest(prompt="p", num_inference_steps=2).to_json()
    assert base["image_path"] is None
    for given in ("/data/a.png", ["/data/a.png"]):
        request = RolloutRequest.from_json({**base, "image_path": given})
        assert request.image_path == ("/data/a.png",)
        assert request.to_json()["image_path"] == ["/data/a.png"]  # a list, as sglang-diffusion takes it
        assert RolloutRequest.from_json(json.loads(json.dumps(request.to_json()))) == request
    with pytest.raises(RequestError, match=r"^image_path: takes one conditioning image per request, got 2"):
        RolloutRequest.from_json({**base, "image_path": ["/a.png", "/b.png"]})
    for bad in ("", [""], [3], {"path": "/a.png"}):
        with pytest.raises(RequestError, match=r"^image_path: must be a path or a list of paths"):
            RolloutRequest.from_json({**base, "image_path": bad})


def test_check_request_image_follows_the_family(images):
    text, image = RolloutRequest(prompt="p"), RolloutRequest(prompt="p", image_path=(str(images["a"]),))
    check_request_image(SD3Family, text)
    check_request_image(RequiredImageSD3, image)
    # A registered family by its registered name, an unregistered class by its own name.
    with pytest.raises(RequestError, match=r"^image_path: the sd3 family takes no conditioning image"):
        check_request_image(SD3Family, image)
    with pytest.raises(RequestError, match=r"^image_path: the RequiredImageSD3 family is image-to-video and needs a conditioning image"):
        check_request_image(RequiredImageSD3, text)

    class Named(RequiredImageSD3):
        family_name = "acme_i2v"

    with pytest.raises(RequestError, match=r"^image_path: the acme_i2v family is image-to-video"):
        check_request_image(Named, text)


def test_the_engine_checks_the_image_before_anything_runs(tiny_sd3, images):
    from miles_core.engine.embedded import EmbeddedEngine
    from miles_core.engine.limits import RequestLimits

    engine = EmbeddedEngine.from_checkpoint(tiny_sd3, "sd3")
    request = RolloutRequest(prompt="a red cube", num_inference_steps=1, rollout=False, image_path=(str(images["a"]),))
    with pytest.raises(RequestError, match=r"^image_path: the sd3 family takes no conditioning image"):
        engine.generate_sync(request)
    assert len(engine.generate_sync(replace(request, image_path=None))) == 1  # control: text only runs
    # A family that requires an image: a request without one is refused; the server's
    # limits still derive from their image-less dummy request.
    required = EmbeddedEngine(RequiredImageSD3(engine.family.pipeline))
    with pytest.raises(RequestError, match=r"^image_path: the RequiredImageSD3 family is image-to-video"):
        required.generate_sync(replace(request, image_path=None))
    assert RequestLimits.derive(required.family).as_dict() == RequestLimits.derive(engine.family).as_dict()


def test_a_family_class_must_agree_with_its_spec_on_image_input():
    registration = get_host().registries.model_family.get("sd3")
    assert registration.spec.image_input == "none" and registration.load() is SD3Family
    wrong = Registration(replace(registration.spec, image_input="required"), registration.plugin)
    with pytest.raises(ComponentLoadError, match=r"SD3Family has image_input 'none' but the ModelFamilySpec says 'required'"):
        wrong.load()
    with pytest.raises(ValueError, match=r"image_input 'sometimes' must be 'none', 'optional' or 'required'"):
        replace(registration.spec, image_input="sometimes")


# -- prompt rows -----------------------------------------------------------------------------------


def _rows(path: Path, *rows: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


@pytest.mark.exercises("--image-key")
def test_prompt_rows_carry_their_image_relative_to_the_file(tmp_path, images):
    shutil.copy(images["a"], tmp_path / "a.png")
    data = _rows(
        tmp_path / "data" / "rows.jsonl",
        {"input": "one", "picture": "../a.png"},
        {"input": "two", "picture": str(images["b"])},
        {"input": "three"},
    )
    one, two, three = load_prompts(data, image_key="picture")
    assert one.image == str((tmp_path / "data" / "../a.png").absolute()) and Path(one.image).read_bytes() == images["a"].read_bytes()
    assert (two.image, three.image) == (str(images["b"]), None)
    # A text-only family does not read the key at all (here: a value that would be refused).
    bad = _rows(tmp_path / "bad.jsonl", {"input": "one", "image": 5})
    assert load_prompts(bad)[0].image is None
    cases = [
        ({"input": "one", "image": 5}, r"bad\.jsonl:1: 'image' must be a non-empty string \(an image path\), got 5"),
        ({"input": "one", "image": " "}, r"bad\.jsonl:1: 'image' must be a non-empty string"),
        ({"input": "one", "image": "nope.png"}, r"bad\.jsonl:1: 'image': no such image file .*nope\.png"),
        ({"input": "one"}, r"bad\.jsonl:1: no 'image' key: the wan2_2_i2v family is image-to-video \(set --image-key"),
    ]
    for row, message in cases:
        with pytest.raises(PromptDataError, match=message):
            load_prompts(_rows(tmp_path / "bad.jsonl", row), image_key="image", image_required_by="wan2_2_i2v")


def _config(tiny_sd3, *extra: str):
    return resolve_config([*tiny_train_args(tiny_sd3, Path(str(tiny_sd3) + "-run")), *extra])


def test_the_run_reads_images_only_for_a_family_that_takes_them(tiny_sd3, tmp_path, images):
    text = _config(tiny_sd3)
    assert family_image_input(text) == ("none", "sd3") and run_image_options(text) == {}
    required = _config(tiny_sd3, *CUSTOM, "--image-key", "picture")
    assert family_image_input(required) == ("required", "RequiredImageSD3")
    assert run_image_options(required) == {"image_key": "picture", "image_required_by": "RequiredImageSD3"}
    # Rollout and evaluation requests carry a row's image; a row without one, none.
    rows = load_prompts(_rows(tmp_path / "rows.jsonl", {"input": "a", "picture": str(images["a"])}, {"input": "b"}), image_key="picture")
    settings = RolloutSettings.from_config(required)
    group = Microgroup(group_index=0, offset=0, size=1, seed=0)
    assert [settings.request(r.prompt, group, (), (), image=r.image).image_path for r in rows] == [(str(images["a"]),), None]
    assert [r.image_path for r in eval_requests(required, rows)] == [(str(images["a"]),), None]


@pytest.mark.exercises("--image-key", "--loss-type", "--rollout-engine")
def test_training_refuses_what_an_image_to_video_family_cannot_train_with(tiny_sd3):
    def image_errors(*extra: str) -> list[str]:
        return [e for e in training_errors(_config(tiny_sd3, *extra)) if "image" in e]

    assert image_errors() == [] and image_errors(*CUSTOM) == []
    assert image_errors(*CUSTOM, "--image-key", "input") == [
        "--image-key 'input': a prompt row keeps its prompt and its image under different keys"
    ]
    (sft,) = image_errors(*CUSTOM, "--loss-type", "sft_loss", "--diffusion-num-sde-steps", "0")
    assert sft.startswith("--loss-type sft_loss: the RequiredImageSD3 family is image-to-video, and SFT with a conditioning image")
    assert image_errors("--loss-type", "sft_loss", "--diffusion-num-sde-steps", "0") == []  # control: a text family trains SFT
    assert image_errors(*CUSTOM, "--rollout-engine", "sglang") == [
        "--rollout-engine sglang: the RequiredImageSD3 family is image-to-video, and sglang-diffusion's image-to-video "
        "denoising_env is not verified against this family's; use --rollout-engine embedded or http"
    ]
    assert image_errors("--rollout-engine", "sglang") == []  # control
    # An optional image: text-to-video rows may run on sglang (rows with an image are
    # refused once they are read, see the next test).
    assert image_errors(*OPTIONAL, "--rollout-engine", "sglang") == []


@pytest.mark.exercises("--loss-type")
def test_a_supervised_loss_is_told_by_its_spec_not_its_name(tiny_sd3):
    """A loss registered under another name that trains on supervised rows is refused for a
    "required" family as sft_loss is; the name alone decides nothing."""
    registry = get_host().registries.loss
    sft = registry.get("sft_loss")
    registry.add(Registration(replace(sft.spec, name="my_sft"), sft.plugin))
    try:
        errors = training_errors(_config(tiny_sd3, *CUSTOM, "--loss-type", "my_sft", "--diffusion-num-sde-steps", "0"))
    finally:
        registry.discard("my_sft")
    assert any(e.startswith("--loss-type my_sft: the RequiredImageSD3 family is image-to-video, and SFT") for e in errors), errors


def _prepare(config) -> None:
    """prepare_run up to the engine: an engine factory that must not be reached."""
    import asyncio

    from miles_core.training.run import prepare_run

    def no_engine(_config):
        raise AssertionError("the engine was built before the rows were checked")

    asyncio.run(prepare_run(config, engine_factory=no_engine, log=lambda line: None))


@pytest.mark.exercises("--rollout-engine", "--eval-prompt-data")
def test_rows_with_an_image_are_refused_on_sglang_before_the_engine_starts(tiny_sd3, tmp_path, images):
    from miles_core.errors import ConfigError
    from miles_core.training.run import check_engine_images

    run = tmp_path / "run"
    with_image = tiny_train_args(tiny_sd3, run, image=images["a"])
    config = resolve_config([*with_image, *OPTIONAL, "--rollout-engine", "sglang"])
    with pytest.raises(
        ConfigError,
        match=r"^--rollout-engine sglang: --prompt-data has rows with a conditioning image \(.*a\.png\), and image-to-video rollouts are not supported on sglang yet",
    ):
        _prepare(config)
    # Eval rows count too; training rows without images are fine on sglang.
    text_rows = tiny_train_args(tiny_sd3, tmp_path / "text")
    evals = _rows(tmp_path / "eval.jsonl", {"input": "one", "image": str(images["b"])})
    config = resolve_config(
        [*text_rows, *OPTIONAL, "--rollout-engine", "sglang", "--eval-prompt-data", "held", str(evals), "--eval-interval", "1"]
    )
    with pytest.raises(ConfigError, match=r"^--rollout-engine sglang: --eval-prompt-data held has rows with a conditioning image"):
        _prepare(config)
    # Controls: the same rows on the embedded engine; text rows on sglang.
    records = load_prompts(run / "prompts.jsonl", image_key="image")
    check_engine_images(resolve_config([*with_image, *OPTIONAL]), records)
    check_engine_images(
        resolve_config([*text_rows, *OPTIONAL, "--rollout-engine", "sglang"]), load_prompts(tmp_path / "text" / "prompts.jsonl")
    )


@pytest.mark.exercises("--eval-prompt-data")
def test_eval_rows_are_checked_before_the_engine_is_built(tiny_sd3, tmp_path, images):
    evals = _rows(tmp_path / "eval.jsonl", {"input": "one", "image": str(images["a"])}, {"input": "two"})
    args = [*tiny_train_args(tiny_sd3, tmp_path / "run", image=images["a"]), *CUSTOM, "--eval-prompt-data", "held", str(evals)]
    with pytest.raises(PromptDataError, match=r"eval\.jsonl:2: no 'image' key: the RequiredImageSD3 family is image-to-video"):
        _prepare(resolve_config([*args, "--eval-interval", "1"]))
    # Control: a run that does not evaluate does not read the eval rows (the engine is reached).
    with pytest.raises(AssertionError, match="the engine was built before the rows were checked"):
        _prepare(resolve_config(args))


def test_tiny_train_args_writes_the_image_path_absolute(tmp_path, images, monkeypatch):
    """load_prompts resolves a relative row path against the prompt file's folder, so the
    helper writes the image's absolute path whatever the working directory."""
    shutil.copy(images["a"], tmp_path / "frame.png")
    monkeypatch.chdir(tmp_path)
    tiny_train_args("checkpoint", tmp_path / "run", family="sd3", image="frame.png")
    rows = load_prompts(tmp_path / "run" / "prompts.jsonl", image_key="image", image_required_by="x")
    assert {r.image for r in rows} == {str(tmp_path / "frame.png")}


def test_train_refuses_rows_without_an_image_with_exit_2(tiny_sd3, tmp_path, capsys):
    from miles_core.cli.main import main

    args = tiny_train_args(tiny_sd3, tmp_path / "run")
    assert main(["train", *args, *CUSTOM]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        f"miles-core train: error: {tmp_path / 'run' / 'prompts.jsonl'}:1: no 'image' key: the RequiredImageSD3 family is "
        "image-to-video (set --image-key to the image's key)"
    ]


def test_samples_carry_their_image_through_a_rollout_and_its_dump(tiny_sd3, tmp_path, images):
    import asyncio

    from miles_core.engine.embedded import EmbeddedEngine
    from miles_core.rollout.data import PromptRecord
    from miles_core.rollout.generate import generate_rollout, strategy_from_config
    from miles_core.training.debug_data import load_rollout_data, save_rollout_data

    config = _config(tiny_sd3, *CUSTOM, "--diffusion-num-steps", "2", "--diffusion-num-sde-steps", "1")
    engine = EmbeddedEngine(RequiredImageSD3(EmbeddedEngine.from_checkpoint(tiny_sd3, "sd3").family.pipeline))
    records = [PromptRecord("a red cube", image=str(images["a"])), PromptRecord("a blue ball", image=str(images["b"]))]
    groups = asyncio.run(generate_rollout(engine, RolloutSettings.from_config(config), 0, records, strategy_from_config(config)))
    assert [[s.image for s in group] for group in groups] == [[str(images["a"])] * len(groups[0]), [str(images["b"])] * len(groups[1])]
    samples = [s for group in groups for s in group]
    template = str(tmp_path / "dump_{rollout_id}.pt")
    save_rollout_data(template, 0, samples, torch.zeros(len(samples)))
    loaded, _ = load_rollout_data(template, 0)
    assert [s.image for s in loaded] == [s.image for s in samples]


def test_the_prompt_store_fingerprint_covers_the_vae_of_an_image_family(tiny_sd3):
    """An image family's encode runs the VAE on the image: a nudged VAE weight gives another
    fingerprint; the control (the same pipeline as a text-only family) ignores the VAE."""
    from miles_core.engine.embedded import EmbeddedEngine
    from miles_core.engine.prompt_store import encoder_fingerprint

    text = EmbeddedEngine.from_checkpoint(tiny_sd3, "sd3").family
    image = RequiredImageSD3(text.pipeline)

    def nudged(family, module: torch.nn.Module) -> tuple[str, str]:
        base = encoder_fingerprint(family)
        with torch.no_grad():
            first = next(module.parameters()).view(-1)
            first[0] += 1e-3
            try:
                return base, encoder_fingerprint(family)
            finally:
                first[0] -= 1e-3

    before, after = nudged(image, image.pipeline.vae)
    assert before != after
    before, after = nudged(text, text.pipeline.vae)
    assert before == after  # control


# -- micro-batches ---------------------------------------------------------------------------------


def _pair(sample: int, cond: Conditioning) -> TrainPair:
    params = GenerationParams(height=32, width=32, num_inference_steps=4, guidance_scale=1.0)
    x = {"latents": torch.zeros(4)}
    return TrainPair(sample, 0, x, x, torch.tensor(0.0), 0.5, 0.4, 0.9, 0.0, 0.0, cond, params, denoiser="transformer")


def test_micro_batches_never_mix_conditionings_of_different_keys_or_shapes():
    text = Conditioning({"encoder_hidden_states": torch.zeros(1, 8, 16)})
    image = Conditioning({"encoder_hidden_states": torch.zeros(1, 8, 16), "image_latents": torch.zeros(1, 20, 1, 4, 4)})
    larger = Conditioning({"encoder_hidden_states": torch.zeros(1, 8, 16), "image_latents": torch.zeros(1, 20, 1, 8, 4)})
    guided = Conditioning(text.positive, {"encoder_hidden_states": torch.zeros(1, 8, 16)})
    pairs = [_pair(0, text), _pair(1, image), _pair(2, image), _pair(3, larger), _pair(4, guided), _pair(5, text)]
    flat = SimpleNamespace(micro_batch_size=6, micro_batch_size_sample=None)
    assert [[p.sample_index for p in b] for b in micro_batches(pairs, flat)] == [[0], [1, 2], [3], [4], [5]]
    tile = SimpleNamespace(micro_batch_size_sample=6, micro_batch_size_tstep=1, diffusion_train_iter_order="sample_major")
    assert [[p.sample_index for p in b] for b in micro_batches(pairs, tile)] == [[0, 5], [1, 2], [3], [4]]
    # Control: equal conditionings share one micro-batch.
    assert [len(b) for b in micro_batches([_pair(i, image) for i in range(4)], flat)] == [4]


def test_conditioning_cat_refuses_parts_with_different_tensors():
    text = Conditioning({"encoder_hidden_states": torch.zeros(1, 8, 16)})
    image = Conditioning({"encoder_hidden_states": torch.zeros(1, 8, 16), "image_latents": torch.zeros(1, 20, 1, 4, 4)})
    with pytest.raises(
        ValueError,
        match=r"cannot batch conditionings with different positive tensors: \['encoder_hidden_states'\] and \['encoder_hidden_states', 'image_latents'\]",
    ):
        Conditioning.cat([text, image])
    with pytest.raises(ValueError, match=r"different positive tensors"):
        Conditioning.cat([image, text])  # the first part's keys alone must not decide
    assert Conditioning.cat([image, image]).positive["image_latents"].shape[0] == 2  # control


def _nft_item(sample: int, frames: int, image: bool) -> tuple:
    positive = {"encoder_hidden_states": torch.zeros(8, 16)}
    if image:
        positive["image_latents"] = torch.zeros(20, 1, 4, 4)
    env = {
        "pos_cond_kwargs": positive,
        "neg_cond_kwargs": None,
        "image_kwargs": {"height": 32, "width": 32, "num_frames": 5},
        "guidance": {"guidance_scale": 1.0},
    }
    trajectory = {"timesteps": torch.tensor([1000.0, 500.0]), "sigmas": torch.tensor([1.0, 0.5, 0.0])}
    return (sample, 0, {"latents": torch.zeros(4, frames, 2, 2)}, trajectory, env)


def test_nft_micro_batches_never_mix_shapes_or_conditionings():
    """TI2V's text rows denoise F latent frames, its image rows F - 1 with image latents:
    DiffusionNFT groups them before cutting micro-batches, so every micro-batch stacks and
    concatenates; its noise has the group's shape."""
    from miles_core.training.pairs import conditioning_from_env
    from miles_core.training.trainer import nft_groups, nft_micro_batches

    items = [_nft_item(0, 2, False), _nft_item(1, 1, True), _nft_item(2, 2, False), _nft_item(3, 1, True), _nft_item(4, 2, False)]
    groups = nft_groups(items)
    assert [[item[0] for item in group] for group in groups] == [[0, 2, 4], [1, 3]]
    batches = list(nft_micro_batches(groups, {0, 1, 2, 3, 4}, 2, torch.Generator().manual_seed(0), ["latents"]))
    assert [[item[0] for item in chunk] for chunk, _ in batches] == [[0, 2], [4], [1, 3]]
    for chunk, noise in batches:
        assert noise["latents"].shape == torch.stack([item[2]["latents"] for item in chunk]).shape
        Conditioning.cat([conditioning_from_env(item[4]) for item in chunk])  # one set of tensors per micro-batch
    # A rank's share keeps micro-batches within a group, and its rows of the same draws.
    mine = list(nft_micro_batches(groups, {2, 3, 4}, 2, torch.Generator().manual_seed(0), ["latents"]))
    assert [[item[0] for item in chunk] for chunk, _ in mine] == [[2, 4], [3]]
    assert torch.equal(mine[0][1]["latents"], torch.cat([batches[0][1]["latents"][1:], batches[1][1]["latents"]]))
    assert torch.equal(mine[1][1]["latents"], batches[2][1]["latents"][1:])
    # Control: uniform items form one group cut by count, as before.
    uniform = [_nft_item(i, 2, False) for i in range(5)]
    assert [len(chunk) for chunk, _ in nft_micro_batches(nft_groups(uniform), set(range(5)), 2, torch.Generator(), ["latents"])] == [
        2,
        2,
        1,
    ]


@pytest.mark.exercises("--eval-config", "--rollout-engine")
def test_eval_config_sets_with_images_are_named_by_their_file_on_sglang(tiny_sd3, tmp_path, images):
    from miles_core.errors import ConfigError

    evals = _rows(tmp_path / "eval.jsonl", {"input": "one", "image": str(images["b"])})
    config_file = tmp_path / "eval.yaml"
    config_file.write_text(f"eval:\n  datasets:\n    - name: held\n      path: {evals}\n", encoding="utf-8")
    text_rows = tiny_train_args(tiny_sd3, tmp_path / "text")
    args = [*text_rows, *OPTIONAL, "--eval-config", str(config_file), "--eval-interval", "1"]
    with pytest.raises(
        ConfigError,
        match=rf"^--rollout-engine sglang: --eval-config {re.escape(str(config_file))} dataset held has rows with a conditioning image",
    ):
        _prepare(resolve_config([*args, "--rollout-engine", "sglang"]))
    # Control: the same set on the embedded engine reaches the engine.
    with pytest.raises(AssertionError, match="the engine was built before the rows were checked"):
        _prepare(resolve_config(args))


@pytest.mark.exercises("--eval-config", "--image-key")
def test_an_eval_config_set_whose_input_key_is_the_image_key_is_refused(tiny_sd3, tmp_path):
    config_file = tmp_path / "eval.yaml"

    def image_errors(input_key: str, *extra: str) -> list[str]:
        config_file.write_text(
            f"eval:\n  datasets:\n    - name: held\n      path: held.jsonl\n      input_key: {input_key}\n", encoding="utf-8"
        )
        config = _config(tiny_sd3, *extra, "--eval-config", str(config_file))
        return [e for e in training_errors(config) if "image" in e]

    (error,) = image_errors("image", *OPTIONAL)
    assert error == (
        f"--eval-config {config_file}: dataset 'held': --image-key 'image' is also its input_key: "
        "a prompt row keeps its prompt and its image under different keys"
    )
    # Controls: another input key; a text-only family never reads the image key.
    assert image_errors("caption", *OPTIONAL) == []
    assert image_errors("image") == []
