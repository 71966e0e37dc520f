"""`once bench engine --contention` on a tiny model, and the CPU facts it rests on."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from once import OPENMP_WAIT_VARS, yield_waiting_threads
from once.bench.engine_bench import main
from once.bench.engine_bench.contention import BUSY_LOOP, summarize
from once.cpus import cpu_quota, usable_cores
from once.engine.testing import make_tiny_model


def test_usable_cores_is_the_affinity_capped_by_the_cgroup_quota(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cpu_quota(tmp_path) is None and usable_cores(tmp_path) == affinity
    (tmp_path / "cpu.max").write_text("50000 100000\n")  # half a CPU: still one thread
    assert cpu_quota(tmp_path) == 0.5 and usable_cores(tmp_path) == 1
    (tmp_path / "cpu.max").write_text(f"{150000 * affinity} 100000\n")
    assert usable_cores(tmp_path) == affinity  # a quota above the mask: the mask
    v1 = tmp_path / "v1"
    v1.mkdir()
    (v1 / "cpu.cfs_quota_us").write_text("100000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert cpu_quota(v1) == 1.0 and usable_cores(v1) == 1


def test_openmp_threads_yield_unless_the_user_chose_a_wait_policy():
    env: dict[str, str] = {}
    yield_waiting_threads(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}
    chosen = {"GOMP_SPINCOUNT": "300000"}
    yield_waiting_threads(chosen)
    assert chosen == {"GOMP_SPINCOUNT": "300000"}
    # Set by `import once`, before torch loads its OpenMP runtime.
    code = "import once, os, torch; print(os.environ['OMP_WAIT_POLICY'])"
    env = {k: v for k, v in os.environ.items() if k not in OPENMP_WAIT_VARS}
    printed = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert printed.stdout.strip() == "PASSIVE"


def test_summary_ratios_against_the_fair_share():
    rows = [
        {"busy": 0, "c8_tok_s": 100.0},
        {"busy": 1, "c8_tok_s": 50.0},
        {"busy": 2, "c8_tok_s": 20.0},
        {"busy": 0, "c8_tok_s": 100.0},
    ]
    summary = summarize(rows, cores=2)
    assert summary["contention_ratio_1busy"] == 0.5 and summary["fair_share_1busy"] == 0.667
    assert summary["bar_1busy"] is True  # 0.5 >= 0.7 x 2/3
    assert summary["contention_ratio_2busy"] == 0.2 and summary["fair_share_2busy"] == 0.5
    assert summary["bar_2busy"] is False  # 0.2 < 0.7 x 1/2


def busy_loops_running() -> int:
    count = 0
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            count += BUSY_LOOP.encode() in cmdline.read_bytes()
        except OSError:
            pass
    return count


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_contention_bench_measures_each_policy_and_stops_its_busy_loops(tmp_path):
    model = make_tiny_model(tmp_path / "m")
    out = tmp_path / "contention.json"
    argv = ["--contention", "--model", str(model), "--threads", "1", "--repeats", "1"]
    assert main([*argv, "--output-tokens", "4", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    for policy in ("passive", "spin"):
        conditions = results[policy]["conditions"]
        assert [row["busy"] for row in conditions] == [0, 1, 2, 0]
        assert all(row["c1_tok_s"] > 0 and row["c8_tok_s"] > 0 for row in conditions)
        assert all("load_avg_1m" in row and row["c8_cpu_ms_per_token"] >= 0 for row in conditions)
    cores = results["cores"]
    assert results["fair_share_2busy"] == round(cores / (cores + 2), 3)
    assert results["contention_ratio_1busy"] == results["passive"]["contention_ratio_1busy"]
    assert busy_loops_running() == 0
