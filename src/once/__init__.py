"""once: an agent-serving stack that never pays twice for the same work."""

__version__ = "0.1.0"
