import os

os.environ.setdefault("MILES_STRICT_PLUGINS", "1")

import torch

torch.set_num_threads(1)
