"""Sequence parallelism (``--sequence-parallel-size``, ``--ulysses-degree``) on the tiny SD3
pipeline: four gloo ranks, data-parallel 2 x sequence-parallel 2 (Ulysses), compute the
loss and the gradient of one process on the same rollout; so does the 3-D mesh with
hybrid sharding; with every attention made local (the control) they do not. Plus the
configuration rules, checked before anything loads.

SD3 has no plan in diffusers: :mod:`miles_sd3.sequence_parallel` splits both its image
and text streams and pads the 333 text tokens to 334 (masked), so this also checks the
padding. One spawn runs every four-rank scenario (see
:mod:`miles_core.sequence_parallel_checks`).
"""

from __future__ import annotations

import pytest

from miles_core import sequence_parallel_checks as checks
from miles_core.config.resolve import resolve_config, training_errors
from miles_core.errors import ConfigError

SIZE = ("--diffusion-height", "32", "--diffusion-width", "32")
DP2_SP2 = ("--actor-num-nodes", "4", "--sequence-parallel-size", "2", "--ulysses-degree", "2")
SCENARIOS = {
    "dp2_sp2": DP2_SP2,
    "hsdp_sp2": (*DP2_SP2, "--dp-replicate-size", "2"),
    "local_attention": (*DP2_SP2, checks.LOCAL_ATTENTION),
}

GRADIENT_RTOL = 1e-5
"""The reduced gradient of the four ranks against one process's, relative to the largest
gradient element: the split sums attention over keys in another order and the ranks add
partial gradients, which rounds differently. Measured (fp32, gloo): 1.9e-7 for SD3 at
SP 2, 9.3e-7 for Wan 2.2, 1.8e-7 for Qwen-Image; the local-attention control is 1.0 away."""


@pytest.fixture(scope="module")
def args(tiny_sd3, tmp_path_factory):
    return checks.check_args(tiny_sd3, tmp_path_factory.mktemp("sp_run"), *SIZE, family="sd3")


@pytest.fixture(scope="module")
def rollout(args):
    return checks.make_rollout(args)


@pytest.fixture(scope="module")
def reference(args, rollout):
    return checks.train_once(resolve_config(args), rollout)


@pytest.fixture(scope="module")
def four_ranks(args, rollout, tmp_path_factory):
    return checks.run_ranks(4, {name: [*args, *flags] for name, flags in SCENARIOS.items()}, rollout, tmp_path_factory.mktemp("sp_ranks"))


def _ran(results: list[dict]) -> None:
    for rank, result in enumerate(results):
        assert "crash" not in result, f"rank {rank}:\n{result['crash']}"


def _metrics_close(ours: dict, reference: dict) -> bool:
    return ours.keys() == reference.keys() and all(
        ours[k] == pytest.approx(v, rel=1e-5, abs=1e-6) for k, v in reference.items() if not isinstance(v, list)
    )


@pytest.mark.exercises("--sequence-parallel-size", "--ulysses-degree")
def test_data_parallel_2_x_ulysses_2_equals_one_process(four_ranks, reference):
    results = four_ranks["dp2_sp2"]
    _ran(results)
    # Ranks 0-1 and 2-3 split one sample each: data-parallel ranks 0, 0, 1, 1; FSDP2
    # shards over all four (dp_shard x ulysses flattened).
    assert [r["dp_rank"] for r in results] == [0, 0, 1, 1]
    assert {r["mesh"] for r in results} == {(4,)}
    for result in results:
        assert result["metrics"]["train/num_pairs"] == reference["metrics"]["train/num_pairs"] == 2
        assert _metrics_close(result["metrics"], reference["metrics"]), (result["metrics"], reference["metrics"])
        assert checks.gradient_error(result["gradients"], reference["gradients"]) <= GRADIENT_RTOL


@pytest.mark.exercises("--sequence-parallel-size", "--dp-replicate-size")
def test_the_3d_mesh_with_hybrid_sharding_equals_one_process(four_ranks, reference):
    results = four_ranks["hsdp_sp2"]
    _ran(results)
    # (dp_replicate 2, dp_shard 1 x ring 1 x ulysses 2): replicated across the two data-parallel groups.
    assert [r["dp_rank"] for r in results] == [0, 0, 1, 1]
    assert {r["mesh"] for r in results} == {(2, 2)}
    for result in results:
        assert _metrics_close(result["metrics"], reference["metrics"])
        assert checks.gradient_error(result["gradients"], reference["gradients"]) <= GRADIENT_RTOL


def test_local_attention_makes_the_comparison_fail(four_ranks, reference):
    """Control: the same split with each rank attending to its own tokens only."""
    results = four_ranks["local_attention"]
    _ran(results)
    for result in results:
        assert checks.gradient_error(result["gradients"], reference["gradients"]) > 1000 * GRADIENT_RTOL
        assert not _metrics_close(result["metrics"], reference["metrics"])


def test_a_sequence_the_ranks_cannot_share_stops_with_the_sizes(tiny_sd3):
    """4 image tokens (32 x 32 pixels) over 3 ranks: one line naming the sizes, before
    diffusers' own split would assert."""
    import torch
    from diffusers.models._modeling_parallel import ContextParallelInput

    from miles_core.training.sequence_parallel import install_size_checks
    from miles_sd3.family import SD3Family

    family = SD3Family.from_pretrained(tiny_sd3)
    module = family.pipeline.transformer
    split = ContextParallelInput(split_dim=1, expected_dims=3)
    install_size_checks("transformer", module, {"transformer_blocks.0": {"hidden_states": split}}, 3)
    with pytest.raises(ConfigError) as error, torch.no_grad():
        module(
            hidden_states=torch.zeros(1, 4, 4, 4),
            encoder_hidden_states=torch.zeros(1, 6, module.config.joint_attention_dim),
            pooled_projections=torch.zeros(1, module.config.pooled_projection_dim),
            timestep=torch.ones(1),
        )
    assert str(error.value) == (
        "--sequence-parallel-size 3: input hidden_states of transformer_blocks.0 of component transformer has 4 tokens "
        "along dimension 1, which 3 ranks cannot share equally; choose sizes (--diffusion-height, --diffusion-width, "
        "frames, prompt length) whose token counts 3 divides"
    )


# -- configuration rules -------------------------------------------------------------------------


def _errors(tiny_sd3, *flags: str) -> list[str]:
    with pytest.raises(ConfigError) as error:
        resolve_config(["--hf-checkpoint", str(tiny_sd3), "--rollout-batch-size", "4", *flags])
    return error.value.messages


@pytest.mark.exercises("--sequence-parallel-size", "--ulysses-degree")
def test_impossible_splits_are_one_line_errors(tiny_sd3):
    assert _errors(tiny_sd3, "--actor-num-nodes", "3", "--sequence-parallel-size", "2") == [
        "--sequence-parallel-size 2 must divide the train world size 3 (--actor-num-nodes x --actor-num-gpus-per-node): "
        "it splits each sample over that many training ranks"
    ]
    assert _errors(tiny_sd3, "--actor-num-nodes", "4", "--sequence-parallel-size", "4", "--ulysses-degree", "3") == [
        "--ulysses-degree 3 must divide --sequence-parallel-size 4 (the ring degree is SP / Ulysses degree)"
    ]
    assert _errors(tiny_sd3, "--ulysses-degree", "2") == [
        "--ulysses-degree 2 needs --sequence-parallel-size > 1 (it is the Ulysses share of sequence parallelism)"
    ]


@pytest.mark.exercises("--ulysses-degree")
def test_ring_attention_is_refused_on_a_cpu_only_machine(tiny_sd3, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU, whatever this machine has
    assert _errors(tiny_sd3, "--actor-num-nodes", "4", "--sequence-parallel-size", "4", "--ulysses-degree", "2") == [
        "--sequence-parallel-size 4 --ulysses-degree 2: a ring degree of 2 needs an attention backend that returns the "
        "log-sum-exp (flash or cuDNN attention, CUDA only); this machine has no GPU and CPU attention returns none: use "
        "--ulysses-degree 4 (Ulysses only)"
    ]


def test_ulysses_fills_the_split_by_default_and_several_ranks_need_ray(tiny_sd3):
    config = resolve_config(["--hf-checkpoint", str(tiny_sd3), "--rollout-batch-size", "4", *DP2_SP2[:4]])
    assert (config.world_size, config.data_parallel_size, config.ulysses_degree) == (4, 2, 0)  # 0: auto, Ulysses 2
    assert (
        "--actor-num-nodes 4 x --actor-num-gpus-per-node 1 = world size 4: several training ranks run as Ray actors; "
        "add --use-ray (or --ray-address), or pass --actor-num-gpus-per-node 1 to train in one process "
        "(--sequence-parallel-size 2 splits each sample over that many ranks)"
    ) in training_errors(config)
