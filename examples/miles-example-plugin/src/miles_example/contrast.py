"""A reward is a class built with the run's configuration and called on a batch."""

import numpy as np


class Contrast:
    def __init__(self, config=None):
        self.config = config

    def __call__(self, outputs, prompts=None, metadata=None):
        # outputs: images [C, H, W] or videos [C, F, H, W] with values in [0, 1]
        return [float(np.asarray(output, dtype=np.float64).std()) for output in outputs]
