"""The model options that ``generate`` and ``serve-engine`` share: which checkpoint,
which family, which device and dtype."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any


def add_model_options(parser: argparse.ArgumentParser, families: Sequence[str], *, checkpoint_help: str) -> None:
    parser.add_argument("--hf-checkpoint", required=True, metavar="DIR", help=checkpoint_help)
    parser.add_argument(
        "--diffusion-model-family",
        metavar="NAME",
        default=None,
        help=f"model family ({', '.join(families) or 'none installed'}); default: matched from the checkpoint "
        "(its model_index.json, else its name)",
    )
    parser.add_argument("--device", default="auto", help="torch device (default: auto, cuda when available)")
    parser.add_argument(
        "--dtype",
        choices=("auto", "fp32", "bf16", "fp16"),
        default="auto",
        help="model dtype (default: auto, bf16 on cuda and fp32 on the CPU)",
    )


def family_name(checkpoint: str, explicit: str | None, registry: Any) -> str:
    """The explicit ``--diffusion-model-family``, else the family matched from the
    checkpoint (:mod:`miles_core.family_match`); a ``ValueError`` with a one-line message
    otherwise."""
    from miles_core.family_match import match_family

    if explicit is not None:
        if explicit not in registry:
            raise ValueError(registry.unknown_message(explicit, flag="--diffusion-model-family"))
        return explicit
    return match_family(checkpoint, registry).name


def device_and_dtype(device: str, dtype: str) -> tuple[str, Any]:
    """Resolve ``auto``: cuda with bf16 when a GPU is there, else the CPU with fp32."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = "bf16" if str(device).startswith("cuda") else "fp32"
    return device, {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
