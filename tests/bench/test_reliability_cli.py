"""`once bench reliability --quick --json`: every part run or recorded as not run, one
summary with every bar, written where --out says."""

import json

import pytest

from once.bench.reliability.cli import BARS, PART_NAMES, main

pytestmark = pytest.mark.slow


def test_quick_run_writes_one_summary_with_every_bar(tmp_path, capsys):
    out = tmp_path / "bench_reliability.json"
    assert main(["--quick", "--json", "--out", str(out)]) == 0
    summary = json.loads(out.read_text())
    for name in PART_NAMES:
        record = summary[name]
        assert record.get("not_run") == "module missing" or "seconds" in record, record
    assert summary["load"].get("seconds") is not None  # this branch's parts ran
    assert summary["rejection"].get("seconds") is not None
    assert set(summary["bars"]) == {key for key, _, _ in BARS}
    assert summary["load_errors"] == 0
    assert summary["rejection_all_refused"] is True
    assert summary["bars"]["load_errors"] == {"value": 0, "target": "== 0", "met": True}
    assert summary["bars"]["load_sessions"]["met"] is False  # 16 quick sessions, not 256
    table = capsys.readouterr().out
    assert "max_rejection_cpu_ms" in table and "load_errors" in table
