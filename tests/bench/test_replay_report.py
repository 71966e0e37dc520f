"""The replay report, ablation and interleaved traffic, end to end on hand-made sessions.

One run of the tiny model through all five stacks (once, naive and the three ablations),
two sessions at once with scaled tool time, then the report written to disk.
"""

import argparse
import json
from pathlib import Path

import pytest

from once.bench.replay import cli
from once.bench.replay.ablation import ablation_table
from once.bench.replay.pacing import DEFAULT_TOOL_TIME_S, recorded_tool_times, tool_times
from once.bench.replay.report import PLOTS, write_report
from once.bench.traces import MINI_SWE_AGENT, SWEAGENT_1_1, Call, Session

MAX_LEN = 4096
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _session(name: str, edit_at: int | None = None) -> Session:
    system = {"role": "system", "content": "You are a careful agent. " * 20}
    task = {"role": "user", "content": f"Task {name}: fix the bug in parser.py. " * 10}
    history: list[dict] = [system, task]
    calls = []
    for index in range(4):
        messages = list(history)
        if edit_at is not None and index >= edit_at:
            messages[1] = {"role": "user", "content": "(task elided)"}
        output = {"role": "assistant", "content": f"Step {index}: run `ls -la src/` " * 6}
        calls.append(Call(index=index, messages=tuple(messages), output=output))
        history += [output, {"role": "user", "content": f"observation {index}\n" * 15}]
    return Session(f"hand/{name}", MINI_SWE_AGENT, Path(name), tuple(calls))


def _args(**overrides) -> argparse.Namespace:
    args = cli.build_parser().parse_args(["--max-model-len", str(MAX_LEN), "--no-progress"])
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


@pytest.fixture(scope="module")
def ablated_report():
    sessions = [("folder-a", _session("a")), ("folder-b", _session("b", edit_at=2))]
    args = _args(ablate=True, concurrency=2, pacing="recorded", time_scale=0.005)
    import asyncio

    return asyncio.run(cli.run_replay(sessions, args))


def test_report_files_name_every_source_folder_and_bar_figure(ablated_report, tmp_path):
    paths = write_report(ablated_report, tmp_path / "out")
    assert {p.name for p in paths} == {"report.json", "report.md", *PLOTS}
    for name in PLOTS:
        data = (tmp_path / "out" / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 2000
    assert json.loads((tmp_path / "out" / "report.json").read_text()) == json.loads(
        json.dumps(ablated_report)
    )
    text = (tmp_path / "out" / "report.md").read_text()
    for folder, row in ablated_report["sources"].items():
        assert folder in text
        assert f"{row['computed_ratio']:.3f}" in text and f"{row['ideal_ratio']:.3f}" in text
    assert f"Unattributed misses: **{ablated_report['unattributed_misses']}**" in text
    assert "## Ablation" in text and "prefix cache -> off" in text
    assert "Concurrency 2, pacing `recorded`" in text
    assert f"**{ablated_report['prefill_ratio']}**" in text
    for name in PLOTS:
        assert f"]({name})" in text


def test_each_ablation_costs_what_its_optimization_saves(ablated_report):
    rows = {row["stack"]: row for row in ablated_report["ablation"]}
    assert set(rows) == {"once-http", "once-full-render", "once-no-cache"}
    once = ablated_report["total"]["once"]
    # HTTP full requests: many more bytes; the gateway finds each resent conversation's
    # state by its messages' hashes (prefix_states.py), so it tokenizes no more than
    # over WebSocket.
    assert rows["once-http"]["bytes_received_saved"] > 0
    assert rows["once-http"]["tokens_tokenized_saved"] == 0
    # Full render: same bytes on the wire, more tokens tokenized, same compute.
    assert rows["once-full-render"]["tokens_tokenized_saved"] > 0
    assert rows["once-full-render"]["computed_tokens"] == once["computed_tokens"]
    # No prefix cache: the engine computes more; the gateway's work is unchanged.
    assert rows["once-no-cache"]["computed_tokens_saved"] > 0
    assert rows["once-no-cache"]["tokens_tokenized"] == once["tokens_tokenized"]
    no_cache = ablated_report["ablation_totals"]["once-no-cache"]
    assert no_cache["miss_causes"].get("no_prefix_cache", 0) > 0


def test_interleaved_ledger_still_reconciles_with_counters(ablated_report):
    assert ablated_report["unattributed_misses"] == 0
    for name, per_session in ablated_report["calls"].items():
        rows = [row for rows in per_session.values() for row in rows]
        counters = ablated_report["counters"][name]
        assert (
            sum(r["computed_tokens"] for r in rows)
            == (counters["engine"]["num_computed_prompt_tokens"])
        )
        assert sum(r["tokens_tokenized"] for r in rows) == counters["gateway"]["tokenized_tokens"]
        assert all(r["prompt_matches_plan"] and r["output_matches_recording"] for r in rows)
    traffic = ablated_report["traffic"]
    assert traffic["tool_time_origins"] == {
        "hand/a": f"fixed {DEFAULT_TOOL_TIME_S} s",
        "hand/b": f"fixed {DEFAULT_TOOL_TIME_S} s",
    }
    # Two sessions of 4 calls at once, 3 waits of 10 ms each: the pacing really waited.
    assert all(wall >= 0.03 for wall in traffic["stack_wall_s"].values())


def test_recorded_tool_times_come_from_swe_agent_execution_time(tmp_path):
    path = tmp_path / "s.traj"
    steps = [
        {"action": "ls", "response": "r", "execution_time": 0.5},
        {"action": "", "response": "Exit due to cost limit", "execution_time": 9.0},
        {"action": "cat x", "response": "r", "execution_time": 1.5},
    ]
    path.write_text(json.dumps({"trajectory": steps}))
    session = Session("x/s", SWEAGENT_1_1, path, ())
    assert recorded_tool_times(session) == [0.5, 1.5]
    assert tool_times(session, 2, pacing="recorded", time_scale=2.0) == (
        [1.0, 3.0],
        "execution_time",
    )
    assert tool_times(session, 2, pacing="fast", time_scale=1.0) == (None, "fast")
    steps[2]["execution_time"] = "slow"
    path.write_text(json.dumps({"trajectory": steps}))
    with pytest.raises(ValueError, match=r"s\.traj: trajectory\[2\]\.execution_time"):
        recorded_tool_times(session)


def test_fixed_tool_time_where_none_is_recorded_and_bad_pacing():
    session = _session("c")
    assert recorded_tool_times(session) is None
    waits, origin = tool_times(session, 3, pacing="recorded", time_scale=0.5)
    assert waits == [DEFAULT_TOOL_TIME_S * 0.5] * 3 and origin.startswith("fixed")
    with pytest.raises(ValueError, match="pacing"):
        tool_times(session, 3, pacing="slow", time_scale=1.0)
    with pytest.raises(ValueError, match="time-scale"):
        tool_times(session, 3, pacing="recorded", time_scale=-1.0)


def test_bad_traffic_flags_are_refused(capsys):
    assert cli.main(["--concurrency", "0"]) == 2
    assert cli.main(["--time-scale", "-1"]) == 2
    assert "--concurrency" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--pacing", "slow"])


def test_ablation_table_needs_only_the_variants_that_ran():
    base = {"bytes_received": 100, "tokens_tokenized": 50, "computed_tokens": 10, "wall_s": 1.0}
    variant = {"bytes_received": 400, "tokens_tokenized": 50, "computed_tokens": 30, "wall_s": 2.5}
    rows = ablation_table({"once": base, "once-no-cache": variant})
    assert len(rows) == 1
    row = rows[0]
    assert row["computed_tokens_saved"] == 20 and row["computed_tokens_factor"] == 3.0
    assert row["bytes_received_saved"] == 300 and row["wall_s_saved"] == 1.5
