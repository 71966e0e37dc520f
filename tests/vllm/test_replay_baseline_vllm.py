"""`once replay --baseline vllm` end to end: SmolLM2 through once's stacks, then the same
two calls to a live vLLM server of the column's own (Chat Completions, the full history
each call), and the vs_vllm ledger from vLLM's own counters. About a minute on two cores,
most of it vLLM's start; no figure here depends on timing. The replay runs in a process
of its own, as a user runs it: its two SmolLM2 engines (once's and naive's) take ~3 GB,
which the test process would otherwise keep beside everything else it loaded."""

import json
import os
import subprocess
import sys

import pytest

from once.fleet.vllm_server import vllm_missing_reason

SESSION = "django__django-11179"  # mini-swe-agent: append-only, 1.5k-1.6k prompt tokens


def test_replay_with_the_vllm_column():
    reason = vllm_missing_reason()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    argv = [
        "--model",
        "smollm2",
        "--sessions",
        SESSION,
        "--max-calls",
        "2",
        "--max-output-tokens",
        "16",
        "--max-model-len",
        "4096",
        "--baseline",
        "vllm",
        "--no-progress",
        "--json",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "once.bench.replay.cli", *argv], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)

    first, second = report["vllm"]["calls"][f"mini-swe-agent__gemini-3-pro-preview/{SESSION}"]
    for call in (first, second):
        assert "error" not in call
        # vLLM tokenized the whole prompt; its counters split it into cached + computed.
        assert call["tokens_tokenized"] == call["prompt_tokens"]
        assert call["cached_tokens"] + call["computed_tokens"] == call["prompt_tokens"]
        assert call["usage_cached_tokens"] == call["cached_tokens"]
        assert call["finish_reason"] == "stop"  # the forced text ended within max_tokens
    # Stateless, yet its prefix cache held the first call: the second computes far less.
    assert first["cached_tokens"] == 0 and second["cached_tokens"] > 0
    assert second["computed_tokens"] < first["computed_tokens"] / 4

    total = report["total"]["vs_vllm"]
    assert total == report["sources"]["mini-swe-agent__gemini-3-pro-preview"]["vs_vllm"]
    assert total["calls"] == 2 and total["append_only"]
    assert total["prompt_ratio"] == 1.0  # the same render on both sides for this source
    # once sends the second call as a delta and tokenizes only its new items.
    assert total["bytes_ratio"] < 1 and total["tokenized_ratio"] < 1
    assert total["computed_ratio"] is not None and total["ttft_p50_ratio"] is not None
    assert set(total["bars"]) == {
        "computed_ratio",
        "tokenized_ratio",
        "bytes_ratio",
        "ttft_p50_ratio",
    }
    probe = report["vllm"]["responses_probe"]
    assert probe["calls"][0]["status"] == 200 and len(probe["calls"]) == 2
