"""Training: advantages, train pairs, the trainer and the run loop."""
