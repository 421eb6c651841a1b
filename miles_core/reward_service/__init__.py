"""Rewards over HTTP: the wire, the server and the client (docs/rewards.md, "Rewards as a service")."""
