"""`once bench reliability --quick --json`: the parts asked for run, the others recorded as
not run, one summary with every bar, written where --out says. (Each part's own tests run
its entry point: here only the two cheapest, for the wiring.)"""

import json

import pytest

from once.bench.reliability.cli import BARS, PART_NAMES, main

pytestmark = pytest.mark.slow


def test_quick_run_writes_one_summary_with_every_bar(tmp_path, capsys):
    out = tmp_path / "bench_reliability.json"
    selected = ["load", "rejection"]
    assert main(["--quick", "--json", "--out", str(out), "--parts", *selected]) == 0
    summary = json.loads(out.read_text())
    for name in PART_NAMES:
        record = summary[name]
        if name in selected:
            assert "seconds" in record, record
        else:
            assert record == {"not_run": "not selected"}
    assert summary["load"].get("seconds") is not None
    assert summary["rejection"].get("seconds") is not None
    assert set(summary["bars"]) == {key for key, _, _ in BARS}
    assert summary["load_errors"] == 0
    assert summary["rejection_all_refused"] is True
    assert summary["bars"]["load_errors"] == {"value": 0, "target": "== 0", "met": True}
    assert summary["bars"]["load_sessions"]["met"] is False  # 16 quick sessions, not 256
    table = capsys.readouterr().out
    assert "max_rejection_cpu_ms" in table and "load_errors" in table
