"""miles-core: reinforcement-learning post-training for flow-matching diffusion models.

Plugins import what they need from :mod:`miles_core.api`, the declared plugin API;
everything else in this package is internal. Importing this package stays light (no
torch, no diffusers).
"""

from __future__ import annotations

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("miles-core")
except _metadata.PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0"

__all__ = ["__version__"]
