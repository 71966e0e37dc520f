"""Model definitions for the engine."""
