"""The aesthetic reward: the full path (registered reward, resolved configuration, real
transformers and weight loading) on a tiny random CLIP model whose image embeddings are
768 wide, with a random head saved as safetensors and as a .pth state dict, checked
against a direct computation of the LAION MLP on the L2-normalised embedding."""

import collections

import pytest
import torch

from miles_core.errors import RewardError
from miles_rewards.aesthetic import AestheticHead

from ._clip_tiny import as_pil, build_reward, config_errors, image_embeddings, load_direct, random_image, save_tiny_clip

LAYERS = {"layers.0": (768, 1024), "layers.2": (1024, 128), "layers.4": (128, 64), "layers.6": (64, 16), "layers.7": (16, 1)}


class NotATensor:
    """A pickled object that weights_only loading must refuse."""

    def __reduce__(self):
        return (print, ("this must never run",))


def random_head_state(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, (fan_in, fan_out) in LAYERS.items():
        state[f"{name}.weight"] = torch.randn(fan_out, fan_in, generator=generator) / fan_in**0.5
        state[f"{name}.bias"] = torch.randn(fan_out, generator=generator) * 0.1
    return state


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    root = tmp_path_factory.mktemp("aesthetic")
    clip = save_tiny_clip(root / "clip", projection_dim=768)
    state = random_head_state()
    from safetensors.torch import save_file

    save_file(state, str(root / "head.safetensors"))
    torch.save(collections.OrderedDict(state), root / "sac+logos+ava1-l14-linearMSE.pth")
    return {
        "clip": clip,
        "safetensors": root / "head.safetensors",
        "pth": root / "sac+logos+ava1-l14-linearMSE.pth",
        "state": state,
        "root": root,
    }


def aesthetic(clip, head, *args):
    return build_reward("aesthetic", "--aesthetic-clip-path", str(clip), "--aesthetic-head-path", str(head), *args)


def direct_scores(weights, images):
    """The reference computation, written out: normalised CLIP image embedding through
    five linear layers without activations (eval mode: no dropout)."""
    model, processor = load_direct(weights["clip"])
    x = image_embeddings(model, processor.image_processor, images)
    for name in LAYERS:
        x = x @ weights["state"][f"{name}.weight"].T + weights["state"][f"{name}.bias"]
    return x.squeeze(-1).tolist()


@pytest.mark.exercises("--aesthetic-clip-path", "--aesthetic-head-path")
@pytest.mark.parametrize("fmt", ["safetensors", "pth"])
def test_full_path_matches_the_mlp_on_the_normalised_embedding(weights, fmt):
    reward = aesthetic(weights["clip"], weights[fmt])
    assert not reward.head.training
    images = [random_image(seed) for seed in range(3)]
    scores = reward(images, ["ignored"] * 3, [{}] * 3)
    expected = direct_scores(weights, [as_pil(image) for image in images])
    assert scores == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert reward(images, None) == pytest.approx(scores, rel=1e-6)  # the prompt plays no part; dropout is off
    # Controls: another image changes the score; so does skipping the normalisation.
    assert reward([random_image(11)], None)[0] != pytest.approx(scores[0], rel=1e-4)
    model, processor = load_direct(weights["clip"])
    with torch.no_grad():
        raw = model.get_image_features(**processor.image_processor(images=[as_pil(images[0])], return_tensors="pt"))
        raw = raw if isinstance(raw, torch.Tensor) else raw.pooler_output
        unnormalised = AestheticHead()
        unnormalised.load_state_dict(weights["state"])
        assert unnormalised.eval()(raw).item() != pytest.approx(scores[0], rel=1e-3)


@pytest.mark.exercises("--aesthetic-batch-size", "--aesthetic-num-frames")
def test_video_frames_and_batches(weights):
    frames = [random_image(30 + i) for i in range(4)]
    video = torch.stack(frames, dim=1)  # [C, F, H, W]
    per_frame = direct_scores(weights, [as_pil(f) for f in frames])
    reward = aesthetic(weights["clip"], weights["pth"], "--aesthetic-batch-size", "3")
    calls = []
    forward = reward.model.get_image_features
    reward.model.get_image_features = lambda **kw: calls.append(kw["pixel_values"].shape[0]) or forward(**kw)
    assert reward([video, frames[0]], None) == pytest.approx([sum(per_frame) / 4, per_frame[0]], rel=1e-5)
    assert calls == [3, 2]
    two = aesthetic(weights["clip"], weights["pth"], "--aesthetic-num-frames", "2")([video], None)
    assert two == [pytest.approx((per_frame[0] + per_frame[3]) / 2, rel=1e-5)]


def test_a_gray_one_channel_output_is_scored_as_rgb(weights):
    reward = aesthetic(weights["clip"], weights["safetensors"])
    gray = torch.full((1, 40, 48), 0.3)
    assert reward([gray], None) == pytest.approx(reward([gray.expand(3, -1, -1)], None), rel=1e-6)


def bad_head_message(weights, path) -> str:
    with pytest.raises(RewardError) as caught:
        aesthetic(weights["clip"], path)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"--aesthetic-head-path {path}: ")
    return message


def test_bad_head_files_are_one_line_errors_naming_the_flag_and_path(weights):
    root = weights["root"]
    state = dict(weights["state"])
    state["layers.2.weight"] = torch.zeros(128, 512)
    torch.save(state, root / "wrong_shape.pth")
    assert "layers.2.weight is [128, 512], expected [128, 1024]" in bad_head_message(weights, root / "wrong_shape.pth")

    state = {k: v for k, v in weights["state"].items() if not k.startswith("layers.7")}
    from safetensors.torch import save_file

    save_file(state, str(root / "missing.safetensors"))
    assert "missing layers.7.bias, layers.7.weight" in bad_head_message(weights, root / "missing.safetensors")

    renamed = {f"mlp.{k}": v for k, v in weights["state"].items()}
    torch.save(renamed, root / "renamed.pt")
    assert "unexpected mlp.layers.0.bias" in bad_head_message(weights, root / "renamed.pt")

    torch.save({"layers.0.weight": NotATensor()}, root / "objects.pth")
    assert "only plain state dicts are loaded" in bad_head_message(weights, root / "objects.pth")

    torch.save(torch.zeros(3), root / "tensor.bin")
    assert "not a state dict of tensors (got Tensor)" in bad_head_message(weights, root / "tensor.bin")

    (root / "garbage.safetensors").write_bytes(b"not a safetensors file")
    assert "cannot read the head's weights" in bad_head_message(weights, root / "garbage.safetensors")


def test_a_clip_model_of_another_width_is_refused(weights, tmp_path):
    narrow = save_tiny_clip(tmp_path / "narrow", projection_dim=64)
    with pytest.raises(RewardError) as caught:
        aesthetic(narrow, weights["safetensors"])
    assert str(caught.value) == (
        f"--aesthetic-clip-path {narrow}: its image embeddings have 64 numbers; the aesthetic head takes 768 "
        "(CLIP ViT-L/14, openai/clip-vit-large-patch14)"
    )


@pytest.mark.exercises("--aesthetic-clip-path", "--aesthetic-head-path")
def test_missing_and_invalid_paths_are_one_line_config_errors(weights, tmp_path):
    assert config_errors("--rm-type", "aesthetic") == [
        "--aesthetic-clip-path is required with the aesthetic reward (--rm-type aesthetic)",
        "--aesthetic-head-path is required with the aesthetic reward (--rm-type aesthetic)",
    ]
    clip = ["--aesthetic-clip-path", str(weights["clip"])]
    missing = tmp_path / "head.pth"
    assert config_errors("--rm-type", "aesthetic", *clip, "--aesthetic-head-path", str(missing)) == [
        f"--aesthetic-head-path {missing}: no such file"
    ]
    text = tmp_path / "head.txt"
    text.write_text("x")
    assert config_errors("--rm-type", "aesthetic", *clip, "--aesthetic-head-path", str(text)) == [
        f"--aesthetic-head-path {text}: expected a .safetensors, .pth, .pt or .bin file"
    ]
    assert config_errors(
        "--rm-type", "aesthetic", "--aesthetic-clip-path", "./no/such/clip", "--aesthetic-head-path", str(weights["pth"])
    ) == ["--aesthetic-clip-path ./no/such/clip: no such directory (nor a hub id like org/name)"]
    assert (
        config_errors(
            "--rm-type", "aesthetic", "--aesthetic-clip-path", "openai/clip-vit-large-patch14", "--aesthetic-head-path", str(weights["pth"])
        )
        == []
    )
    assert config_errors("--rm-type", "aesthetic", *clip, "--aesthetic-head-path", str(weights["pth"]), "--aesthetic-batch-size", "0") == [
        "--aesthetic-batch-size 0: must be at least 1"
    ]
