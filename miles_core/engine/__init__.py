"""Rollout engines: the ``POST /rollout/generate`` contract, the sampler, and engines."""
