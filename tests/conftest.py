import os

os.environ.setdefault("MILES_STRICT_PLUGINS", "1")

import torch

torch.set_num_threads(1)


import pytest  # noqa: E402

PROMPTS = ['{"input": "a red cube"}', '{"input": "a blue ball"}', '{"input": "a green tree"}']


@pytest.fixture(scope="session")
def tiny_sd3(tmp_path_factory):
    """The tiny SD3 pipeline, built once per test session (tests only read it). Its name
    matches the sd3 family's patterns, so commands can find the family themselves."""
    from miles_sd3.family import SD3Family

    return SD3Family.build_tiny_pipeline(tmp_path_factory.mktemp("models") / "stable-diffusion-3-tiny")


@pytest.fixture(scope="session")
def prompts(tmp_path_factory):
    """A three-prompt JSONL file."""
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path
