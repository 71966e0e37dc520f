import json

import pytest

from once.sim.workload import (
    load_agent_sessions,
    load_mooncake,
    scale_arrivals,
    shared_data_dir,
    text_block_hashes,
)
from tests.sim.conftest import make_request


def _write_trace(path, rows):
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    return path


def test_mooncake_records_become_requests_in_arrival_order(tmp_path):
    path = _write_trace(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 2000, "input_length": 600, "output_length": 5, "hash_ids": [0, 9]},
            {"timestamp": 1000, "input_length": 512, "output_length": 0, "hash_ids": [0]},
            {"timestamp": 90_000, "input_length": 10, "output_length": 1, "hash_ids": [3]},
        ],
    )
    requests = load_mooncake(path, minutes=1)
    assert [r.arrival_s for r in requests] == [1.0, 2.0]  # the 90 s record is cut off
    assert requests[0].num_output_tokens == 1  # at least the first token
    assert requests[1].block_hashes == (0, 9) and requests[1].num_prompt_tokens == 600


@pytest.mark.parametrize(
    "row",
    [
        {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0]},
        {"timestamp": 0, "input_length": 600, "output_length": 5},
        {"timestamp": "soon", "input_length": 1, "output_length": 1, "hash_ids": [0]},
        {"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []},
    ],
)
def test_bad_mooncake_records_are_refused_with_their_line(tmp_path, row):
    path = _write_trace(tmp_path / "bad.jsonl", [row])
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_mooncake(path)


def test_the_real_conversation_trace_loads():
    requests = load_mooncake(limit=50)
    assert len(requests) == 50
    assert all(len(r.block_hashes) == -(-r.num_prompt_tokens // 512) for r in requests)


def test_text_blocks_share_hashes_exactly_as_far_as_the_text_does():
    base = "x" * 2048 * 2 + "tail"
    same_prefix = "x" * 2048 + "y" * 2048
    a = text_block_hashes(base, 512)
    b = text_block_hashes(same_prefix, 512)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]
    assert text_block_hashes("short", 512) == ()


def test_agent_sessions_are_closed_loops_sharing_their_prefix():
    if not (shared_data_dir() / "agent_traces").is_dir():
        pytest.skip("no agent traces on this machine")
    requests = load_agent_sessions(limit=1, think_s=1.5)
    assert requests[0].after is None and requests[0].think_s == 0
    assert all(r.after == p.request_id for p, r in zip(requests, requests[1:], strict=False))
    later = requests[-1]
    assert later.think_s == 1.5 and later.session_key
    shared = sum(
        1 for x, y in zip(requests[0].block_hashes, later.block_hashes, strict=False) if x == y
    )
    assert shared >= 1  # the later call repeats the first call's prefix


def test_scale_arrivals_multiplies_times_and_refuses_nonsense():
    requests = [make_request("a", 10.0, (1,)), make_request("b", 20.0, (2,))]
    assert [r.arrival_s for r in scale_arrivals(requests, 0.5)] == [5.0, 10.0]
    with pytest.raises(ValueError):
        scale_arrivals(requests, 0)
