"""`once bench spec`: speculative decoding on recorded agent sessions (issue 7's bars)."""

from once.bench.spec_bench.cli import main

__all__ = ["main"]
