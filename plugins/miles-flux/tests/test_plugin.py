"""Registration of the FLUX plugin without model code: the entry point and spec, import
weight, what the JSON files of a checkpoint say (pipeline class, guidance, size multiple,
native size), the configuration rules through the real resolver and the command line,
and the recipe's published values.

The checkpoints here are hand-written JSON (model_index.json, transformer/config.json,
vae/config.json): everything the configuration reads, no weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from miles_core import testing
from miles_core.api import CheckpointError, ConfigError, ModelFamily, ModelFamilySpec, resolve_config
from miles_core.cli.main import main
from miles_core.plugin_manager import PluginHost
from miles_flux import plugin
from miles_flux.checkpoint import FLUX1, FLUX2, KLEIN, FluxCheckpoint, read_checkpoint
from miles_flux.config_rules import cfg_parallel_argument
from miles_flux.family import FluxFamily
from miles_flux.plugin import KLEIN_GUIDANCE_SCALE

RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "flux.yaml"

FLOW_GRPO_LORA_TARGETS = {
    # flow_grpo scripts/train_flux.py: joint attention of both streams, and both MLPs
    "attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0",
    "attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
    "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
}  # fmt: skip

COMPONENTS = {
    FLUX1: {
        "transformer": ["diffusers", "FluxTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "text_encoder_2": ["transformers", "T5EncoderModel"],
    },
    KLEIN: {
        "transformer": ["diffusers", "Flux2Transformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLFlux2"],
        "text_encoder": ["transformers", "Qwen3ForCausalLM"],
    },
    FLUX2: {
        "transformer": ["diffusers", "Flux2Transformer2DModel"],
        "vae": ["diffusers", "AutoencoderKLFlux2"],
        "text_encoder": ["transformers", "Mistral3ForConditionalGeneration"],
    },
}
"""model_index.json's components of each pipeline (as in the released checkpoints)."""


def write_checkpoint(
    directory: Path,
    pipeline: str = FLUX1,
    *,
    guidance_embeds: bool | None = None,
    is_distilled: bool | None = None,
    vae_blocks: int = 4,
    single_layers: object = 2,
) -> Path:
    """The JSON of a FLUX checkpoint, as the released ones lay it out (defaults: the
    released model's guidance; a VAE of ``vae_blocks`` blocks, 2 ** (blocks - 1) x)."""
    directory.mkdir(parents=True)
    index: dict = {"_class_name": pipeline, "_diffusers_version": "0.42.1", "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]}
    index.update(COMPONENTS[pipeline])
    if is_distilled is not None:
        index["is_distilled"] = is_distilled
    (directory / "model_index.json").write_text(json.dumps(index), encoding="utf-8")
    if guidance_embeds is None:
        guidance_embeds = pipeline != KLEIN
    transformer = {"_class_name": COMPONENTS[pipeline]["transformer"][1], "guidance_embeds": guidance_embeds}
    if pipeline == KLEIN:
        transformer["num_single_layers"] = single_layers
    for sub, config in (
        ("transformer", transformer),
        ("vae", {"_class_name": COMPONENTS[pipeline]["vae"][1], "block_out_channels": [128, 256, 512, 512][:vae_blocks]}),
    ):
        (directory / sub).mkdir()
        (directory / sub / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory


@pytest.fixture(scope="module")
def host() -> PluginHost:
    # Strict loading: pluggy checks each hookimpl against its hookspec, unknown hooks fail.
    return testing.load_plugin("flux", "miles-flux")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("flux-json")
    return {
        "dev": write_checkpoint(root / "dev"),
        "schnell": write_checkpoint(root / "schnell", guidance_embeds=False),
        "dev-vae4x": write_checkpoint(root / "dev-vae4x", vae_blocks=3),
        "klein": write_checkpoint(root / "klein", KLEIN, is_distilled=True),
        "klein-base": write_checkpoint(root / "klein-base", KLEIN, is_distilled=False),
        "flux2-dev": write_checkpoint(root / "flux2-dev", FLUX2),
    }


def errors_of(*argv: str) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        resolve_config(["--rollout-batch-size", "1", *argv])
    return caught.value.messages


# -- registration -----------------------------------------------------------------------


def test_entry_point_registers_the_family_class(host: PluginHost) -> None:
    assert host.record("flux").entry_point == "miles_flux.plugin"
    assert host.pm.get_plugin("flux") is plugin
    assert host.record("flux").registers == {"model_family": ["flux"]}
    assert host.registries.model_family.get("flux").load() is FluxFamily
    assert issubclass(FluxFamily, ModelFamily)
    assert FluxFamily.pipeline_class == "diffusers:FluxPipeline"  # a hub id the name cannot place
    assert FluxFamily.tiny_variants == ("dev", "klein", "klein-base")


def test_spec_values(host: PluginHost) -> None:
    spec = host.registries.model_family.get("flux").spec
    assert isinstance(spec, ModelFamilySpec)
    assert spec.ref == "miles_flux.family:FluxFamily"
    assert spec.description
    assert spec.checkpoint_patterns == ("flux",)
    assert spec.pipeline_classes == ("FluxPipeline", "Flux2KleinPipeline", "Flux2Pipeline")
    assert spec.checkpoint_check is None
    assert spec.trainable_components == ("transformer",)
    assert spec.lora_target_modules == plugin.LORA_TARGET_MODULES
    assert set(spec.lora_target_modules) == FLOW_GRPO_LORA_TARGETS and len(spec.lora_target_modules) == 12
    # FLUX.2 names its MLPs differently: a klein checkpoint gets its own default targets.
    assert spec.lora_target_modules_by_pipeline == (("Flux2KleinPipeline", plugin.KLEIN_LORA_TARGET_MODULES),)
    # flow_grpo's FLUX group of 24, in microgroups of 8 (recipes/flux.yaml says why).
    assert (spec.n_samples_per_prompt, spec.rollout_microgroup_size) == (24, 8)
    assert spec.default_guidance_scale == 3.5  # FluxPipeline.__call__'s default and flow_grpo's
    assert spec.default_guidance_scale_by_pipeline == (("Flux2KleinPipeline", 4.0),)  # Flux2KleinPipeline.__call__'s
    assert spec.lora_target_modules_for == "miles_flux.plugin:klein_lora_targets"
    assert spec.generation_options == ("true_cfg_scale",)
    assert spec.supports_cfg_training


def test_checkpoint_patterns_match_the_released_names(host: PluginHost) -> None:
    patterns = host.registries.model_family.get("flux").spec.checkpoint_patterns
    for name in ("black-forest-labs/FLUX.1-dev", "black-forest-labs/FLUX.2-klein-4B", "/ckpt/my-flux-finetune"):
        assert any(p in name.lower() for p in patterns), name
    assert resolve_config(["--hf-checkpoint", "black-forest-labs/FLUX.1-dev", "--rollout-batch-size", "1"]).model_family == "flux"


def test_plugin_and_family_stay_light() -> None:
    testing.assert_plugin_is_light("flux", "miles-flux")
    # The configuration check runs while the command line resolves.
    testing.assert_import_is_light("miles_flux.plugin", "miles_flux.config_rules", "miles_flux.checkpoint", "miles_flux.flux2")


# -- what the JSON says -----------------------------------------------------------------


@pytest.mark.parametrize(
    "name, expected",
    [
        ("dev", FluxCheckpoint(FLUX1, guidance_distilled=True, step_distilled=False, vae_scale_factor=8)),
        ("schnell", FluxCheckpoint(FLUX1, guidance_distilled=False, step_distilled=False, vae_scale_factor=8)),
        ("dev-vae4x", FluxCheckpoint(FLUX1, guidance_distilled=True, step_distilled=False, vae_scale_factor=4)),
        ("klein", FluxCheckpoint(KLEIN, guidance_distilled=False, step_distilled=True, vae_scale_factor=8)),
        ("klein-base", FluxCheckpoint(KLEIN, guidance_distilled=False, step_distilled=False, vae_scale_factor=8)),
        ("flux2-dev", FluxCheckpoint(FLUX2, guidance_distilled=True, step_distilled=False, vae_scale_factor=8)),
    ],
)
def test_read_checkpoint_from_json(checkpoints: dict[str, Path], name: str, expected: FluxCheckpoint) -> None:
    found = read_checkpoint(checkpoints[name])
    assert found == expected
    assert found.size_multiple == 2 * expected.vae_scale_factor


def test_read_checkpoint_from_hub_ids_and_other_directories(tmp_path: Path) -> None:
    def read(name: str) -> tuple | None:
        found = read_checkpoint(name)
        return found and (found.pipeline, found.guidance_distilled, found.step_distilled, found.vae_scale_factor)

    assert read("black-forest-labs/FLUX.1-dev") == (FLUX1, True, False, 8)
    assert read("black-forest-labs/FLUX.1-schnell") == (FLUX1, False, False, 8)
    assert read("black-forest-labs/FLUX.2-klein-4B") == (KLEIN, False, True, 8)
    assert read("black-forest-labs/FLUX.2-klein-base-9B") == (KLEIN, False, False, 8)
    assert read("black-forest-labs/FLUX.2-dev") == (FLUX2, True, False, 8)
    assert read("stabilityai/stable-diffusion-3.5-medium") is None
    # A local directory is read, never its name: no model_index.json, or another pipeline.
    assert read(str(tmp_path)) is None
    other = tmp_path / "flux-named-qwen"
    other.mkdir()
    (other / "model_index.json").write_text(json.dumps({"_class_name": "QwenImagePipeline"}), encoding="utf-8")
    assert read(str(other)) is None


def test_native_size_from_json(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    assert FluxFamily.native_size("black-forest-labs/FLUX.1-dev") is None
    assert FluxFamily.native_size(tmp_path) is None
    # default_sample_size 128 x the VAE factor: 4 VAE blocks (8x) give 1024, 3 blocks 512.
    assert FluxFamily.native_size(checkpoints["dev"]) == (1024, 1024)
    assert FluxFamily.native_size(checkpoints["klein"]) == (1024, 1024)
    assert FluxFamily.native_size(checkpoints["dev-vae4x"]) == (512, 512)


def test_resolve_pipeline_class_reads_model_index(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    import diffusers

    assert FluxFamily.resolve_pipeline_class(checkpoints["dev"]) is diffusers.FluxPipeline
    assert FluxFamily.resolve_pipeline_class(checkpoints["klein"]) is diffusers.Flux2KleinPipeline
    assert FluxFamily.resolve_pipeline_class("black-forest-labs/FLUX.2-klein-4B") is diffusers.Flux2KleinPipeline
    assert FluxFamily.resolve_pipeline_class() is diffusers.FluxPipeline
    other = tmp_path / "qwen"
    other.mkdir()
    (other / "model_index.json").write_text(json.dumps({"_class_name": "QwenImagePipeline"}), encoding="utf-8")
    with pytest.raises(CheckpointError) as caught:
        FluxFamily.resolve_pipeline_class(other)
    assert str(caught.value) == (
        f"--hf-checkpoint {other}: not a FLUX pipeline (the flux family serves FluxPipeline (FLUX.1 [dev]), "
        "Flux2KleinPipeline (FLUX.2 [klein]); model_index.json names neither)"
    )
    # A hub id its name cannot place (the family chosen by flag) loads as FLUX.1; a fine-tune
    # named flux2-klein-... is klein, not FLUX.2 [dev].
    assert FluxFamily.resolve_pipeline_class("acme/mystery") is diffusers.FluxPipeline
    assert FluxFamily.resolve_pipeline_class("someone/flux2-klein-4b-ft") is diffusers.Flux2KleinPipeline
    # FLUX.2 [dev] is refused before anything is read or downloaded (generate, serve-engine).
    from miles_flux.flux2 import FLUX2_DEV_REFUSAL

    for checkpoint in (str(checkpoints["flux2-dev"]), "black-forest-labs/FLUX.2-dev"):
        with pytest.raises(CheckpointError) as caught:
            FluxFamily.resolve_pipeline_class(checkpoint)
        assert str(caught.value) == f"--hf-checkpoint {checkpoint}: {FLUX2_DEV_REFUSAL}"


# -- configuration rules ----------------------------------------------------------------


@pytest.mark.exercises("--hf-checkpoint")
def test_flux2_dev_is_refused_before_it_loads(checkpoints: dict[str, Path]) -> None:
    from miles_flux.flux2 import FLUX2_DEV_REFUSAL

    assert FLUX2_DEV_REFUSAL.startswith("FLUX.2 [dev] (Flux2Pipeline) is not served: ")
    for checkpoint in (str(checkpoints["flux2-dev"]), "black-forest-labs/FLUX.2-dev"):
        # Only this line, whatever else is asked: the other rules are about a model that does not run.
        assert errors_of("--hf-checkpoint", checkpoint, "--diffusion-height", "8", "--diffusion-true-cfg-scale", "4") == [
            f"--hf-checkpoint {checkpoint}: {FLUX2_DEV_REFUSAL}"
        ]


def test_another_pipeline_directory_is_refused_for_the_flux_family(tmp_path: Path) -> None:
    other = tmp_path / "qwen"
    other.mkdir()
    (other / "model_index.json").write_text(json.dumps({"_class_name": "QwenImagePipeline"}), encoding="utf-8")
    assert errors_of("--hf-checkpoint", str(other), "--diffusion-model-family", "flux") == [
        f"--hf-checkpoint {other}: not a FLUX pipeline directory (its model_index.json names none of FluxPipeline, "
        "Flux2KleinPipeline, Flux2Pipeline), so the flux family cannot load it; drop --diffusion-model-family flux or "
        "point --hf-checkpoint at a FLUX checkpoint"
    ]


@pytest.mark.exercises("--diffusion-height", "--diffusion-width")
def test_sizes_must_split_into_packed_latent_patches(checkpoints: dict[str, Path]) -> None:
    dev = str(checkpoints["dev"])
    assert errors_of("--hf-checkpoint", dev, "--diffusion-height", "520", "--diffusion-width", "500") == [
        "--diffusion-height 520: FLUX sizes must be multiples of 16 (FLUX.1 [dev]'s 8x VAE downsampling times the 2x2 latent packing)",
        "--diffusion-width 500: FLUX sizes must be multiples of 16 (FLUX.1 [dev]'s 8x VAE downsampling times the 2x2 latent packing)",
    ]
    config = resolve_config(["--hf-checkpoint", dev, "--rollout-batch-size", "1", "--diffusion-height", "528", "--diffusion-width", "512"])
    assert (config.diffusion_height, config.diffusion_width) == (528, 512)
    # The multiple is the checkpoint's: a 4x VAE packs 8-pixel patches, so 520 is fine there.
    config = resolve_config(["--hf-checkpoint", str(checkpoints["dev-vae4x"]), "--rollout-batch-size", "1", "--diffusion-height", "520"])
    assert config.diffusion_height == 520
    assert errors_of("--hf-checkpoint", str(checkpoints["klein"]), "--diffusion-width", "72") == [
        "--diffusion-width 72: FLUX sizes must be multiples of 16 (FLUX.2 [klein]'s 8x VAE downsampling times the 2x2 latent packing)"
    ]
    # A checkpoint the plugin cannot read takes the released models' 16.
    assert errors_of("--hf-checkpoint", "acme/mystery", "--diffusion-model-family", "flux", "--diffusion-height", "8") == [
        "--diffusion-height 8: FLUX sizes must be multiples of 16 (the released FLUX VAEs' 8x downsampling times the 2x2 latent packing)"
    ]


@pytest.mark.exercises("--lora-target-modules")
def test_default_lora_targets_follow_the_pipeline_class(checkpoints: dict[str, Path]) -> None:
    def targets(*flags: str) -> list[str]:
        return resolve_config(["--rollout-batch-size", "1", "--use-lora", *flags]).lora_target_modules

    # FLUX.1's twelve for a FLUX.1 directory and for a hub id (read before it is downloaded) ...
    assert targets("--hf-checkpoint", str(checkpoints["dev"])) == list(plugin.LORA_TARGET_MODULES)
    assert targets("--hf-checkpoint", "black-forest-labs/FLUX.1-dev") == list(plugin.LORA_TARGET_MODULES)
    # ... FLUX.2's names for a klein directory (base or distilled), with each single-stream
    # block's attention output by its block-qualified name, as many as the configuration's ...
    blocks = ["single_transformer_blocks.0.attn.to_out", "single_transformer_blocks.1.attn.to_out"]
    assert targets("--hf-checkpoint", str(checkpoints["klein-base"])) == [*plugin.KLEIN_LORA_TARGET_MODULES, *blocks]
    # ... and what the user sets wins.
    assert targets("--hf-checkpoint", str(checkpoints["klein"]), "--lora-target-modules", "attn.to_q") == ["attn.to_q"]


def test_a_klein_configuration_without_a_block_count_is_named(tmp_path: Path) -> None:
    bad = write_checkpoint(tmp_path / "klein", KLEIN, is_distilled=True, single_layers="twenty")
    with pytest.raises(
        ConfigError,
        match=r"lora_target_modules_for miles_flux.plugin:klein_lora_targets failed: ValueError: "
        r"transformer/config.json: num_single_layers 'twenty' is not a count of blocks",
    ):
        resolve_config(["--rollout-batch-size", "1", "--hf-checkpoint", str(bad)])
    # Without the key (an older export): the suffixes alone.
    partial = write_checkpoint(tmp_path / "klein-partial", KLEIN, is_distilled=True, single_layers=None)
    config = json.loads((partial / "transformer" / "config.json").read_text())
    del config["num_single_layers"]
    (partial / "transformer" / "config.json").write_text(json.dumps(config))
    assert resolve_config(["--rollout-batch-size", "1", "--hf-checkpoint", str(partial)]).lora_target_modules == list(
        plugin.KLEIN_LORA_TARGET_MODULES
    )


@pytest.mark.exercises("--diffusion-true-cfg-scale")
def test_true_cfg_is_a_flux1_option(checkpoints: dict[str, Path]) -> None:
    assert errors_of("--hf-checkpoint", str(checkpoints["klein"]), "--diffusion-true-cfg-scale", "4") == [
        "--diffusion-true-cfg-scale 4.0: FLUX.2 [klein] has no true CFG, a FLUX.1 [dev] option (FluxPipeline's true_cfg_scale); "
        "the base model samples with real CFG through --diffusion-guidance-scale > 1, the step-distilled one without guidance"
    ]
    (message,) = errors_of("--hf-checkpoint", str(checkpoints["klein-base"]), "--diffusion-true-cfg-scale", "1")
    assert message.startswith("--diffusion-true-cfg-scale 1.0: FLUX.2 [klein] has no true CFG")
    # Control: FLUX.1 [dev] takes it.
    config = resolve_config(["--hf-checkpoint", str(checkpoints["dev"]), "--rollout-batch-size", "1", "--diffusion-true-cfg-scale", "4"])
    assert config.diffusion_true_cfg_scale == 4.0


@pytest.mark.exercises("--diffusion-guidance-scale")
def test_a_guidance_scale_the_pipeline_ignores_is_refused(checkpoints: dict[str, Path]) -> None:
    klein = str(checkpoints["klein"])
    assert errors_of("--hf-checkpoint", klein, "--diffusion-guidance-scale", "4") == [
        "--diffusion-guidance-scale 4.0: FLUX.2 [klein] (step-distilled) samples without guidance (its pipeline ignores the "
        "scale, is_distilled in model_index.json); leave it unset or at most 1, or use the klein base model for real CFG"
    ]
    assert errors_of("--hf-checkpoint", str(checkpoints["schnell"]), "--diffusion-guidance-scale", "3.5") == [
        "--diffusion-guidance-scale 3.5: this FluxPipeline checkpoint's transformer takes no guidance (guidance_embeds is "
        "false, as in FLUX.1 [schnell]) and the pipeline ignores the scale; leave it unset or at most 1 "
        "(--diffusion-true-cfg-scale > 1 samples with true CFG)"
    ]
    # Unset (Flux2KleinPipeline's own 4.0 fills it, which the step-distilled model ignores) or
    # at most 1 is what the step-distilled model does anyway.
    config = resolve_config(["--hf-checkpoint", klein, "--rollout-batch-size", "1"])
    assert config.diffusion_guidance_scale == KLEIN_GUIDANCE_SCALE == 4.0 and not config.is_user_set("diffusion_guidance_scale")
    # The klein base samples with real CFG at that default; FLUX.1 [dev] keeps FluxPipeline's 3.5.
    for name, default in (("klein-base", 4.0), ("dev", 3.5)):
        assert resolve_config(["--hf-checkpoint", str(checkpoints[name]), "--rollout-batch-size", "1"]).diffusion_guidance_scale == default
    assert (
        resolve_config(["--hf-checkpoint", klein, "--rollout-batch-size", "1", "--diffusion-guidance-scale", "1"]).diffusion_guidance_scale
        == 1.0
    )
    # Controls: the klein base model samples with real CFG at 4, FLUX.1 [dev] embeds 4.
    for name in ("klein-base", "dev"):
        config = resolve_config(["--hf-checkpoint", str(checkpoints[name]), "--rollout-batch-size", "1", "--diffusion-guidance-scale", "4"])
        assert config.diffusion_guidance_scale == 4.0
    # A value from a YAML file is the user's too: the FLUX.1 recipe on a step-distilled klein.
    (message,) = errors_of("--hf-checkpoint", klein, "--custom-config-path", str(RECIPE))
    assert message.startswith("--diffusion-guidance-scale 3.5: FLUX.2 [klein] (step-distilled) samples without guidance")


def test_cfg_parallel_argument_reads_both_spellings() -> None:
    assert cfg_parallel_argument([]) is None
    assert cfg_parallel_argument(["--sglang-enable-cfg-parallel"]) == "--sglang-enable-cfg-parallel"
    assert cfg_parallel_argument(["--sglang-enable-cfg-parallel", "--sglang-num-gpus", "2"]) == "--sglang-enable-cfg-parallel"
    assert cfg_parallel_argument(["--sglang-enable-cfg-parallel", "true"]) == "--sglang-enable-cfg-parallel true"
    assert cfg_parallel_argument(["--sglang-enable-cfg-parallel=false"]) is None
    assert cfg_parallel_argument(["--sglang-cfg-parallel-size", "2"]) == "--sglang-cfg-parallel-size 2"
    assert cfg_parallel_argument(["--sglang-cfg-parallel-size=1"]) is None
    assert cfg_parallel_argument(["--sglang-cfg-parallel-size", "two"]) is None
    assert cfg_parallel_argument(["--sglang-attention-backend", "torch_sdpa"]) is None


@pytest.mark.exercises("--rollout-engine", "--diffusion-true-cfg-scale", "--diffusion-guidance-scale")
def test_cfg_parallelism_needs_an_unconditional_branch(checkpoints: dict[str, Path]) -> None:
    sglang = ("--rollout-engine", "sglang")
    assert errors_of("--hf-checkpoint", str(checkpoints["dev"]), *sglang, "--sglang-enable-cfg-parallel") == [
        "--sglang-enable-cfg-parallel: sglang-diffusion's CFG parallelism gives half the GPUs to an unconditional branch, and "
        "FLUX.1 [dev] samples without one (its guidance scale is an input of the transformer); drop it, or turn on true CFG "
        "with --diffusion-true-cfg-scale > 1 (it is unset)"
    ]
    assert errors_of(
        "--hf-checkpoint", "black-forest-labs/FLUX.1-dev", *sglang, "--sglang-cfg-parallel-size=2", "--diffusion-true-cfg-scale", "1"
    ) == [
        "--sglang-cfg-parallel-size=2: sglang-diffusion's CFG parallelism gives half the GPUs to an unconditional branch, and "
        "FLUX.1 [dev] samples without one (its guidance scale is an input of the transformer); drop it, or turn on true CFG "
        "with --diffusion-true-cfg-scale > 1 (it is 1.0)"
    ]
    assert errors_of("--hf-checkpoint", str(checkpoints["klein"]), *sglang, "--sglang-enable-cfg-parallel") == [
        "--sglang-enable-cfg-parallel: sglang-diffusion's CFG parallelism gives half the GPUs to an unconditional branch, and "
        "FLUX.2 [klein] (step-distilled) samples without one (it takes no guidance); drop it"
    ]
    assert errors_of(
        "--hf-checkpoint", str(checkpoints["klein-base"]), *sglang, "--sglang-enable-cfg-parallel", "--diffusion-guidance-scale", "1"
    ) == [
        "--sglang-enable-cfg-parallel: sglang-diffusion's CFG parallelism gives half the GPUs to an unconditional branch, and "
        "FLUX.2 [klein] (base) has one only with real CFG, --diffusion-guidance-scale > 1 (it is 1.0); drop it or raise the "
        "guidance scale"
    ]
    # Controls: with an unconditional branch, without CFG parallelism, or with no sglang engine to pass it to.
    allowed = [
        ("dev", (*sglang, "--sglang-enable-cfg-parallel", "--diffusion-true-cfg-scale", "4")),
        ("klein-base", (*sglang, "--sglang-enable-cfg-parallel", "--diffusion-guidance-scale", "4")),
        ("dev", (*sglang, "--sglang-enable-cfg-parallel=false", "--sglang-cfg-parallel-size", "1")),
        ("dev", ("--sglang-enable-cfg-parallel",)),  # the embedded engine: noted as having no effect
    ]
    for name, extra in allowed:
        config = resolve_config(["--hf-checkpoint", str(checkpoints[name]), "--rollout-batch-size", "1", *extra])
        assert config.model_family == "flux", (name, extra)


def test_a_broken_rule_is_one_error_line_and_exit_2(checkpoints: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["config", "--hf-checkpoint", str(checkpoints["klein"]), "--rollout-batch-size", "1", "--diffusion-true-cfg-scale", "4"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.splitlines() == [
        "miles-core config: error: --diffusion-true-cfg-scale 4.0: FLUX.2 [klein] has no true CFG, a FLUX.1 [dev] option "
        "(FluxPipeline's true_cfg_scale); the base model samples with real CFG through --diffusion-guidance-scale > 1, the "
        "step-distilled one without guidance"
    ]


# -- the recipe -------------------------------------------------------------------------


@pytest.mark.skipif(not RECIPE.is_file(), reason="recipes/ ships with the miles-core checkout")
def test_the_recipe_has_flow_grpos_flux_values() -> None:
    config = resolve_config(
        ["--hf-checkpoint", "black-forest-labs/FLUX.1-dev", "--rollout-batch-size", "48", "--custom-config-path", str(RECIPE)]
    )
    assert config.model_family == "flux"
    # flow_grpo config/grpo.py:pickscore_flux
    assert (config.n_samples_per_prompt, config.rollout_microgroup_size) == (24, 8)
    assert (config.diffusion_num_steps, config.diffusion_eval_num_steps, config.diffusion_num_sde_steps) == (6, 28, 5)
    assert (config.diffusion_guidance_scale, config.diffusion_true_cfg_scale) == (3.5, None)
    assert (config.diffusion_height, config.diffusion_width) == (512, 512)
    assert (config.diffusion_sde_type, config.diffusion_noise_level, config.diffusion_kl_beta) == ("sde", 0.9, 0.0)
    assert (config.diffusion_clip_range, config.diffusion_adv_clip_max, config.globalize_reward_std) == (1e-4, 5.0, True)
    # flow_grpo scripts/train_flux.py and config/base.py
    assert (config.use_lora, config.lora_rank, config.lora_alpha, config.lora_init_weights) == (True, 64, 128, "gaussian")
    assert set(config.lora_target_modules) == FLOW_GRPO_LORA_TARGETS  # the family's default
    assert (config.lr, config.weight_decay, config.clip_grad, config.num_steps_per_rollout) == (3e-4, 1e-4, 1.0, 2)
    assert yaml.safe_load(RECIPE.read_text(encoding="utf-8"))["diffusion_guidance_scale"] == plugin.DEFAULT_GUIDANCE_SCALE
