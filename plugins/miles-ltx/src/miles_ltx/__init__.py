"""miles-ltx: the LTX-2 / LTX-2.3 model family (video with an audio branch) for miles-core."""
