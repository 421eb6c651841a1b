"""miles-rewards: reward models for miles-core (registered under ``miles.plugins``)."""
