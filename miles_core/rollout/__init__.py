"""Trainer-side rollout: prompt data, seeds, microgroups, samples."""
