"""Cluster simulator (`once sim`): routing policies over simulated replicas on real traces."""

from once.sim.cli import main

__all__ = ["main"]
