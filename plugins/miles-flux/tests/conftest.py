import os

os.environ.setdefault("MILES_STRICT_PLUGINS", "1")
# One torch thread in every test, in runs the tests start too (their thread plan honours it).
os.environ["OMP_NUM_THREADS"] = "1"

import torch

torch.set_num_threads(1)
