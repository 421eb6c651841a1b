"""Runs on a Ray cluster (``--use-ray`` / ``--ray-address``): placement of training ranks,
engine servers and the reward worker, and the actors that host them. Nothing in this
package imports Ray at module level: a run without ``--use-ray`` never loads it."""
