"""Entry point: records only (no numpy, no model), so discovery stays fast."""

from miles_core.api import Flag, RewardSpec, hookimpl


@hookimpl
def miles_register_rewards():
    return [
        RewardSpec(
            name="photo",
            ref="miles_example_reward.photo:Photo",
            description="sharpness (mean absolute neighbour difference) and exposure (closeness to "
            "--photo-exposure-target), as a dict per output",
        )
    ]


@hookimpl
def miles_add_arguments():
    return [
        Flag(
            name="--photo-exposure-target",
            group="reward",
            type="float",
            default=0.5,
            help="Mean pixel value the photo reward's exposure key is highest at (1 there, 0 at black or white).",
        ),
    ]


@hookimpl
def miles_validate_config(config):
    target = config.photo_exposure_target
    if not 0.0 < target < 1.0:
        return [f"--photo-exposure-target {target}: must be strictly between 0 and 1"]
    return []
