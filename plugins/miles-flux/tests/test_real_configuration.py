"""The family contract at real size, on the weightless real configurations under
tests/data/real_checkpoints (their sources: the README there)."""

from __future__ import annotations

import pytest

from miles_core import family_checks

KLEIN_TARGETS = {
    "attn.to_q": 5,
    "attn.to_k": 5,
    "attn.to_v": 5,
    "attn.to_out.0": 5,
    "attn.add_q_proj": 5,
    "attn.add_k_proj": 5,
    "attn.add_v_proj": 5,
    "attn.to_add_out": 5,
    "ff.linear_in": 5,
    "ff.linear_out": 5,
    "ff_context.linear_in": 5,
    "ff_context.linear_out": 5,
    "attn.to_qkv_mlp_proj": 20,
    # each single-stream block's attention output, by block-qualified name
    **{f"single_transformer_blocks.{i}.attn.to_out": 1 for i in range(20)},
}
"""FLUX.2 [klein] 4B's default LoRA targets and the modules each names."""

CASES = family_checks.real_checkpoint_cases(
    __file__,
    [
        (
            "FLUX.1-dev",
            "flux",
            "flux.yaml",
            {"transformer": 11901408320},
            {
                "transformer": {
                    "attn.to_q": 57,
                    "attn.to_k": 57,
                    "attn.to_v": 57,
                    "attn.to_out.0": 19,
                    "attn.add_q_proj": 19,
                    "attn.add_k_proj": 19,
                    "attn.add_v_proj": 19,
                    "attn.to_add_out": 19,
                    "ff.net.0.proj": 19,
                    "ff.net.2": 19,
                    "ff_context.net.0.proj": 19,
                    "ff_context.net.2": 19,
                }
            },
        ),
        *(
            (name, "flux", recipe, {"transformer": 3875544576}, {"transformer": KLEIN_TARGETS})
            # The klein recipe is planned on the base it is written for; the step-distilled
            # release has the same tree.
            for name, recipe in (("FLUX.2-klein-4B", None), ("FLUX.2-klein-base-4B", "flux2_klein.yaml"))
        ),
    ],
)


@pytest.mark.parametrize(("checkpoint", "family", "recipe", "parameters", "targets"), CASES)
def test_real_configuration(checkpoint, family, recipe, parameters, targets, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("neutral")  # a path no family's name patterns match
    family_checks.check_real_configuration(checkpoint, family, workdir, recipe=recipe, parameters=parameters, lora_targets=targets)
