"""The training ranks' process group: ``--distributed-backend`` and
``--distributed-timeout-minutes`` take effect in :func:`miles_core.training.fsdp.init_from_config`.

A lone rank 0 of a two-rank group waits for its peer at the rendezvous; the timeout
bounds that wait, so a short one fails in seconds with one line naming the setup, and a
long one (the control) is still waiting when the short one has long failed.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import pytest

from miles_core.config.resolve import resolve_config
from miles_core.training import fsdp

RAY_TWO_RANKS = (
    "--hf-checkpoint",
    "stabilityai/stable-diffusion-3.5-medium",
    "--rollout-batch-size",
    "2",
    "--n-samples-per-prompt",
    "2",
    "--use-ray",
    "--actor-num-nodes",
    "2",
)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


LONE_RANK = textwrap.dedent(
    """
    import sys, time
    from miles_core.training import fsdp
    began = time.monotonic()
    try:
        fsdp.init_process_group(0, 2, master_addr="127.0.0.1", master_port=int(sys.argv[1]),
                                backend="gloo", timeout_minutes=float(sys.argv[2]))
    except RuntimeError as exc:
        print(f"{time.monotonic() - began:.1f}")
        print(exc)
    """
)


def _lone_rank(timeout_minutes: float, wait_s: float) -> subprocess.CompletedProcess | None:
    """Rank 0 of two joins alone; None when it is still waiting after ``wait_s``."""
    try:
        return subprocess.run(
            [sys.executable, "-c", LONE_RANK, str(_free_port()), str(timeout_minutes)],
            capture_output=True,
            text=True,
            timeout=wait_s,
        )
    except subprocess.TimeoutExpired:
        return None


@pytest.mark.exercises("--distributed-timeout-minutes")
def test_the_timeout_bounds_the_rendezvous_and_the_flag_reaches_it(monkeypatch):
    short = _lone_rank(0.02, wait_s=120)
    assert short is not None and short.returncode == 0, short
    elapsed, message = short.stdout.splitlines()[:2]
    assert float(elapsed) >= 1.0  # 0.02 minutes, rounded by the store to whole seconds
    assert message.startswith("joining the process group failed (rank 0 of 2, gloo, tcp://127.0.0.1:")
    assert "1/2 clients joined" in message
    # The control: with five minutes the same lone rank is still waiting.
    assert _lone_rank(5, wait_s=float(elapsed) + 2) is None

    # init_from_config passes the flag's value (a lone rank at the flag's minimum of one
    # minute would take a minute: record what reaches the real function instead).
    config = resolve_config([*RAY_TWO_RANKS, "--distributed-timeout-minutes", "3"])
    seen: dict = {}
    monkeypatch.setattr(fsdp, "init_process_group", lambda *args, **kwargs: seen.update(kwargs, rank=args))
    fsdp.init_from_config(config, 1, master_addr="127.0.0.1", master_port=1234)
    assert seen == {
        "rank": (1, 2),
        "master_addr": "127.0.0.1",
        "master_port": 1234,
        "backend": "gloo",
        "timeout_minutes": 3,
        "device": None,
        "cpu_backend": None,
    }


@pytest.mark.exercises("--distributed-backend")
def test_the_backend_flag_chooses_the_group_and_nccl_needs_cuda():
    import torch

    gloo = resolve_config([*RAY_TWO_RANKS, "--distributed-backend", "gloo"])
    assert gloo.distributed_backend == "gloo"
    nccl = resolve_config([*RAY_TWO_RANKS, "--distributed-backend", "nccl"])
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: nccl would start")
    with pytest.raises(RuntimeError, match=r"^--distributed-backend nccl needs a CUDA device on every rank; use gloo on CPU$"):
        fsdp.init_from_config(nccl, 0, master_addr="127.0.0.1", master_port=_free_port())
    with pytest.raises(ValueError, match=r"^--distributed-backend mpi: must be one of gloo, nccl$"):
        fsdp.init_process_group(0, 1, master_addr="127.0.0.1", master_port=_free_port(), backend="mpi")
    # A real group of one with the configured backend (in a child: a group is per process).
    probe = textwrap.dedent(
        """
        import sys
        import torch.distributed as dist
        from miles_core.config.resolve import resolve_config
        from miles_core.training import fsdp
        config = resolve_config(sys.argv[2:])
        fsdp.init_process_group(0, 1, master_addr="127.0.0.1", master_port=int(sys.argv[1]),
                                backend=config.distributed_backend)
        print(dist.get_backend())
        fsdp.destroy_process_group()
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, str(_free_port()), *RAY_TWO_RANKS, "--distributed-backend", "gloo"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "gloo"
