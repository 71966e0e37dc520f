"""`once bench structured` end to end on SmolLM2 at a small size."""

import json

import pytest

from once.bench.engine_bench.structured import main

pytestmark = pytest.mark.slow


def test_structured_bench_writes_paired_figures(tmp_path):
    out = tmp_path / "bench_structured.json"
    argv = ["--batch-size", "2", "--max-tokens", "64", "--rounds", "2", "--out", str(out)]
    assert main(argv) == 0
    results = json.loads(out.read_text())
    assert results["num_step_pairs"] > 0
    assert results["free_decode_tokens_per_s"] > 0 < results["constrained_decode_tokens_per_s"]
    assert results["ratio"] == pytest.approx(
        results["constrained_decode_tokens_per_s"] / results["free_decode_tokens_per_s"]
    )
    assert results["num_constrained_outputs"] == 4 and results["valid_fraction"] == 1.0
    assert results["num_masks"] > 0
