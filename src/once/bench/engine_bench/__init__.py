"""`once bench engine`: the once engine against transformers (and llama.cpp) in one run.

Three measurements, each against a baseline measured in the same process:
  1. throughput at concurrency 1/8/32 (128-token prompts, 64 greedy output tokens);
  2. batch-1 decode step time at a 128-token and an 8,000-token context;
  3. a 20-turn session with and without the prefix cache: tokens computed vs tokens new.
"""

from once.bench.engine_bench.cli import BenchOptions, main, run_benchmark

__all__ = ["BenchOptions", "main", "run_benchmark"]
