"""``--deterministic-mode``: what a process of the run needs for deterministic kernels.

One place for it: the one-process run applies it to itself (:func:`apply_deterministic_mode`),
and under Ray every actor the run starts (training ranks, engine hosts and reward-worker
hosts) gets :func:`deterministic_env` in its ``runtime_env``, which the servers they start
(``serve-engine``, ``serve-reward``) inherit; each of those processes applies the same
function when it starts.

torch documents one variable: cuBLAS (CUDA 10.2 and later) is deterministic only with a
fixed workspace, ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (or ``:16:8``, less memory, maybe
slower); without it ``torch.use_deterministic_algorithms(True)`` raises on a cuBLAS call.
It must be in the environment before the process first uses cuBLAS. A value the user gives
in ``--train-env-vars`` wins (``:16:8`` is the other documented setting) and is what every
actor gets.
"""

from __future__ import annotations

import os
from typing import Any

CUBLAS_WORKSPACE = ":4096:8"
"""torch's documented cuBLAS workspace setting for deterministic results."""


def deterministic_env(config: Any) -> dict[str, str]:
    """The environment variables ``--deterministic-mode`` needs (empty when it is off)."""
    if not config.deterministic_mode:
        return {}
    user = config.train_env_vars or {}
    return {"CUBLAS_WORKSPACE_CONFIG": str(user.get("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE))}


def apply_deterministic_mode(config: Any) -> None:
    """With ``--deterministic-mode``: set :func:`deterministic_env` in this process (a value
    already set stays) and switch torch's deterministic algorithms on. Call before CUDA starts."""
    if not config.deterministic_mode:
        return
    import torch

    for name, value in deterministic_env(config).items():
        os.environ.setdefault(name, value)
    torch.use_deterministic_algorithms(True)


__all__ = ["CUBLAS_WORKSPACE", "apply_deterministic_mode", "deterministic_env"]
