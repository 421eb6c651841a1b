"""miles-core plugin for the FLUX family: FLUX.1 [dev] (``FluxPipeline``) and FLUX.2 [klein]
(``Flux2KleinPipeline``).

The entry point is :mod:`miles_flux.plugin`; the family is
:class:`miles_flux.family.FluxFamily`.
"""
