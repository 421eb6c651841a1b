"""Silencing the hub libraries' progress bars and notices in our commands: saving or
loading a tiny local model needs neither, and they drown the command's own output."""

from __future__ import annotations

import os


def quiet_hub_libraries() -> None:
    """Errors only from transformers and diffusers, and no progress bars."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    import diffusers
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
