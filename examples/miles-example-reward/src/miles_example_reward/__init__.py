"""Example reward plugin for miles-core (see docs/rewards.md, "Writing a reward plugin")."""
