"""`once bench structured` end to end on SmolLM2 at a small size."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

# The bench holds two SmolLM2 engines (weights, their oneDNN-packed copy and a 0.5 GiB KV
# pool each): 3.6 GB at its peak on its own, 4.9 GB on top of the suite's pytest process.
# So it runs in a process of its own, with 64 MiB pools (its prompts and outputs need a
# few hundred tokens): 3.1 GB there, and nothing left behind (issue 30).
SMALL_POOLS = """
import functools, sys
from once.bench.engine_bench import structured
structured.StructuredOptions = functools.partial(structured.StructuredOptions, kv_cache_gib=1 / 16)
sys.exit(structured.main(sys.argv[1:]))
"""


def test_structured_bench_writes_paired_figures(tmp_path):
    out = tmp_path / "bench_structured.json"
    argv = ["--batch-size", "2", "--max-tokens", "64", "--rounds", "2", "--out", str(out)]
    done = subprocess.run([sys.executable, "-c", SMALL_POOLS, *argv], timeout=600)
    assert done.returncode == 0
    results = json.loads(out.read_text())
    assert results["num_step_pairs"] > 0
    assert results["free_decode_tokens_per_s"] > 0 < results["constrained_decode_tokens_per_s"]
    assert results["ratio"] == pytest.approx(
        results["constrained_decode_tokens_per_s"] / results["free_decode_tokens_per_s"]
    )
    assert results["num_constrained_outputs"] == 4 and results["valid_fraction"] == 1.0
    assert results["num_masks"] > 0
