"""miles-core plugin for the Cosmos 3 family (``Cosmos3OmniPipeline``).

The entry point is :mod:`miles_cosmos3.plugin`; the family class lives in
:mod:`miles_cosmos3.family` and the tiny offline pipeline builder in :mod:`miles_cosmos3.tiny`.
"""
