"""Cosmos 3 refuses sequence parallelism at configuration time, with the reason: diffusers
ships no context-parallel plan for its packed two-pathway transformer."""

from __future__ import annotations

import pytest

from miles_core.config.resolve import resolve_config
from miles_core.errors import ConfigError


@pytest.mark.exercises("--sequence-parallel-size")
def test_sequence_parallelism_is_refused_with_the_reason() -> None:
    argv = ["--hf-checkpoint", "nvidia/cosmos3-example", "--diffusion-model-family", "cosmos3", "--rollout-batch-size", "2"]
    with pytest.raises(ConfigError) as error:
        resolve_config([*argv, "--actor-num-nodes", "2", "--sequence-parallel-size", "2"])
    assert error.value.messages == [
        "--sequence-parallel-size 2: the cosmos3 family cannot split a sample's tokens: its transformer packs two "
        "pathways (understanding and generation) of ragged lengths with grouped-query attention, which diffusers' "
        "context-parallel plans cannot express; diffusers ships no plan for it"
    ]
    # Control: the same run without sequence parallelism resolves.
    assert resolve_config([*argv, "--actor-num-nodes", "2"]).data_parallel_size == 2
