import os

os.environ.setdefault("MILES_STRICT_PLUGINS", "1")
# One torch thread in every test, in runs the tests start too (their thread plan honours it).
os.environ["OMP_NUM_THREADS"] = "1"
# Every Ray instance of the suite runs without token auth: a process keeps the auth mode of
# its first ray.init (a local one turns token auth on), so the suite's local instances and
# the two-node cluster of tests/ray_nodes.py must agree whichever starts first. They
# listen on this machine only.
os.environ["RAY_AUTH_MODE"] = "disabled"
# A key exported in the shell would make every in-process server require it (serve-engine
# and the router read it at start-up): the tests give keys explicitly.
os.environ.pop("MILES_API_KEY", None)

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


@pytest.fixture(scope="session")
def ray_head(request, tmp_path_factory):
    """One single-node Ray cluster for the whole session (``ray start --head``, see
    tests/ray_nodes.py) with as many logical CPUs as the most any module using ``ray_cluster``
    asks for (its ``RAY_CPUS``, default 4). Its own processes rather than ``ray.init``'s:
    modules connect and disconnect, so its start-up (seconds) is paid once, and
    tests/test_multinode.py, which needs no Ray connected in the process, can run between
    two modules that use it."""
    from tests.ray_nodes import start_local_cluster

    users = [item.module for item in request.session.items if "ray_cluster" in item.fixturenames]
    cpus = max((getattr(module, "RAY_CPUS", 4) for module in users), default=4)
    # Actors inherit the environment their node starts with: it leaves out the variable a
    # one-process --deterministic-mode run earlier in this process set, so only a run's own
    # env reaches them; thread counts are Ray's, as under a plain ray.init.
    cluster = start_local_cluster(tmp_path_factory.mktemp("ray"), [cpus], one_thread=False)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def ray_cluster(ray_head):
    """The session's Ray cluster (``ray_head``), connected for the test module: runs find Ray
    initialised and reuse it. Disconnecting at the module's end ends its actors."""
    import ray

    ray.init(address=ray_head.address, include_dashboard=False, log_to_driver=False)
    yield ray_head
    ray.shutdown()
