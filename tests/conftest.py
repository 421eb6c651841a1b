import os

os.environ.setdefault("MILES_STRICT_PLUGINS", "1")
# Every Ray instance of the suite runs without token auth: a process keeps the auth mode of
# its first ray.init (a local one turns token auth on), so the suite's local instances and
# the two-node cluster of tests/ray_nodes.py must agree whichever starts first. They
# listen on this machine only.
os.environ["RAY_AUTH_MODE"] = "disabled"

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


@pytest.fixture(scope="module")
def ray_cluster(request):
    """One local Ray instance for the test module (``RAY_CPUS`` logical CPUs, set in the
    module, default 4): runs find it initialised and reuse it."""
    import ray

    # Actors inherit the environment Ray starts with: keep out the variable a one-process
    # --deterministic-mode run earlier in this process set, so only a run's own env reaches them.
    cublas = os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    ray.init(num_cpus=getattr(request.module, "RAY_CPUS", 4), include_dashboard=False, log_to_driver=False)
    if cublas is not None:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = cublas
    yield
    ray.shutdown()
