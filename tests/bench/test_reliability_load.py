"""The load run, small: replayed sessions over WebSocket complete without errors.

Figures of time and memory are only checked to be there; their size depends on the
machine.
"""

import pytest

from once.bench.reliability.load import growth_slope_mb_per_1k, run_load
from once.bench.reliability.replay_frames import PREVIOUS, replay_scripts


def test_replay_frames_continue_incrementally_and_each_replay_is_a_new_task():
    scripts = replay_scripts(calls_per_session=4, limit=8)
    assert scripts
    num_incremental = 0
    for script in scripts:
        first, *later = script.frames
        assert first["type"] == "response.create" and first["store"] is False
        assert "previous_response_id" not in first
        for frame in later:
            if frame.get("previous_response_id") == PREVIOUS:
                num_incremental += 1
                assert set(frame) == {"type", "previous_response_id", "input"}
    assert num_incremental > 0
    one, two = scripts[0].frames_for(1), scripts[0].frames_for(2)
    assert one[0]["input"] != two[0]["input"]
    assert "[task 1]" not in str(scripts[0].frames[0])  # the script itself is untouched


def test_growth_slope_is_per_thousand_sessions_and_needs_spread():
    points = [{"completed_sessions": n, "rss_mb": 100 + 0.002 * n} for n in (0, 500, 1000)]
    assert growth_slope_mb_per_1k(points) == pytest.approx(2.0)
    assert growth_slope_mb_per_1k(points[:2]) is None
    flat = [{"completed_sessions": 10, "rss_mb": 100.0 + i} for i in range(4)]
    assert growth_slope_mb_per_1k(flat) is None


@pytest.mark.slow
def test_a_small_load_completes_every_session_without_errors():
    result = run_load(
        sessions=16,
        seconds=3,
        calls_per_session=3,
        token_rate=400,
        output_tokens=8,
        think_s=0.05,
        num_checkpoints=4,
    )
    assert result["load_errors"] == 0, result["load_error_samples"]
    assert result["load_warmup_errors"] == 0
    assert result["load_warmup_sessions"] == 16
    assert result["load_sessions"] == 16
    assert result["load_completed_sessions"] >= 16  # every slot ends the session it started
    assert result["load_requests"] >= 2 * result["load_completed_sessions"]
    assert result["load_added_responses"] == result["load_requests"]
    assert result["load_added_ms_p50"] >= 0
    assert len(result["load_memory_checkpoints"]) == 4
    assert result["gateway_rss_mb_end"] > 0 and result["gateway_rss_mb_start"] > 0
    assert result["load_gateway_log_lines"] == 0, result["load_gateway_log_tail"]
