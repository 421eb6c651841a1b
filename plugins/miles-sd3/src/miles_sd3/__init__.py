"""miles-sd3: the Stable Diffusion 3 / 3.5 model family for miles-core.

The entry point is :mod:`miles_sd3.plugin`; the family class lives in
:mod:`miles_sd3.family` and the tiny offline pipeline builder in :mod:`miles_sd3.tiny`.
"""
