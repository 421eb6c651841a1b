"""A reward that returns several numbers per output: pick the trained one with
--reward-key; the others are logged as reward components."""

import numpy as np


class Photo:
    def __init__(self, config):
        # Built once per run: load models and read the plugin's flags here.
        self.target = config.photo_exposure_target

    def __call__(self, outputs, prompts, metadata):
        # outputs: images [C, H, W] or videos [C, F, H, W], values in [0, 1]
        scores = []
        for output in outputs:
            x = np.asarray(output, dtype=np.float64)
            sharpness = np.abs(np.diff(x, axis=-1)).mean() + np.abs(np.diff(x, axis=-2)).mean()
            exposure = 1.0 - abs(x.mean() - self.target) / max(self.target, 1.0 - self.target)
            scores.append({"sharpness": float(sharpness), "exposure": float(exposure)})
        return scores
