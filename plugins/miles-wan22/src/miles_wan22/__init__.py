"""miles-wan22: the Wan 2.2 model family (two denoising experts, video) for miles-core."""
