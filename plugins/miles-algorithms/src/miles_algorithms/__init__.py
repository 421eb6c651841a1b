"""miles-algorithms: the algorithms peers ship, as a miles-core plugin (registered under
``miles.plugins``): DanceGRPO's constant-noise SDE, MixGRPO's sliding window, GRPO-Guard
and online Flow-DPO."""
