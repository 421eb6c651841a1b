"""Entry point: registration records only, so discovery stays fast."""

from miles_core.api import RewardSpec, SdeBackendSpec, hookimpl


@hookimpl
def miles_register_rewards():
    return [
        RewardSpec(
            name="contrast",
            ref="miles_example.contrast:Contrast",
            description="Standard deviation of the pixel values",
        )
    ]


@hookimpl
def miles_register_sde_backends():
    return [
        SdeBackendSpec(
            name="const_sde",
            ref="miles_example.const_sde:ConstantNoiseSde",
            description="Flow SDE whose diffusion coefficient is the noise level itself",
        )
    ]
