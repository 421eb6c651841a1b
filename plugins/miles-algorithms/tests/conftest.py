import os

os.environ.setdefault("MILES_STRICT_PLUGINS", "1")
# One torch thread in every test, in runs the tests start too (their thread plan honours it).
os.environ["OMP_NUM_THREADS"] = "1"

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_sd3(tmp_path_factory):
    """The tiny SD3 pipeline (miles-sd3's builder, found through the registry), built once
    per session; its name matches the sd3 family's patterns."""
    from miles_core.plugin_manager import get_host

    family = get_host().registries.model_family.get("sd3").load()
    return family.build_tiny_pipeline(tmp_path_factory.mktemp("models") / "stable-diffusion-3-tiny")


@pytest.fixture(scope="session")
def prompts(tmp_path_factory):
    """A two-prompt JSONL file."""
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    path.write_text('{"input": "a red cube"}\n{"input": "a blue ball"}\n')
    return path
