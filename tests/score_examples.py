"""Custom rewards for tests/test_score_command.py, written as a user would."""

from __future__ import annotations


async def group_size_rm(args, samples):
    """Each sample's reward is the number of samples scored with it in one call."""
    return [float(len(samples))] * len(samples)


async def width_rm(args, samples):
    """The image width in pixels, as a dict-valued reward with a second key."""
    return [{"width": float(s.pixels.shape[-1]), "height": float(s.pixels.shape[-2])} for s in samples]
