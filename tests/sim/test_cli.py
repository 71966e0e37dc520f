import json
import random

import pytest

from once.router.policies import POLICIES
from once.sim import main
from once.sim.compare import Scenario, bar_ratios, compare_policies
from tests.sim.conftest import make_profile, make_request


def _mooncake_file(tmp_path, num=120, seed=3):
    # Conversations that grow turn by turn from a few shared system prompts.
    rng = random.Random(seed)
    rows, conversations, next_id = [], [], 1000
    for i in range(num):
        if conversations and rng.random() < 0.7:
            hashes = rng.choice(conversations)
            hashes.extend(range(next_id, next_id + 2))
            next_id += 2
        else:
            hashes = [rng.randrange(3), *range(next_id, next_id + 3)]
            next_id += 3
            conversations.append(hashes)
        rows.append(
            {
                "timestamp": i * 500,
                "input_length": 512 * len(hashes),
                "output_length": rng.randrange(5, 60),
                "hash_ids": list(hashes),
            }
        )
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(row) for row in rows))
    return path


def test_json_report_compares_every_policy_at_equal_load(tmp_path, capsys):
    path = _mooncake_file(tmp_path)
    code = main(["--trace-path", str(path), "--replicas", "3", "--load", "0.7", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert [row["policy"] for row in report["policies"]] == list(POLICIES)
    for key in ("p90_ttft_ratio_vs_best", "goodput_ratio_vs_best", "hit_ratio_vs_bound"):
        assert report[key] is None or report[key] > 0
    rows = {row["policy"]: row for row in report["policies"]}
    assert all(row["num_requests"] == 120 for row in rows.values())
    assert rows["once"]["hit_ratio"] > rows["round_robin"]["hit_ratio"]
    assert report["hit_ratio_vs_bound"] == pytest.approx(
        rows["once"]["hit_ratio"] / report["hit_ratio_bound"]
    )
    assert rows["once"]["hit_ratio"] <= report["hit_ratio_bound"] + 1e-12


def test_text_report_names_the_bar(tmp_path, capsys):
    path = _mooncake_file(tmp_path, num=40)
    assert main(["--trace-path", str(path), "--policies", "round_robin", "once"]) == 0
    out = capsys.readouterr().out
    assert "once vs best other" in out and "round_robin" in out


@pytest.mark.parametrize(
    "argv",
    [
        ["--policies", "nonsense"],
        ["--replicas", "0"],
        ["--load", "0"],
        ["--profile", "tpu-v9"],
        ["--kv-blocks", "5000"],
        ["--trace-path", "/nonexistent/trace.jsonl"],
    ],
)
def test_bad_arguments_exit_2_with_a_message(tmp_path, capsys, argv):
    path = _mooncake_file(tmp_path, num=10)
    args = ["--trace-path", str(path), *argv] if "--trace-path" not in argv else argv
    assert main(args) == 2
    assert "once sim: error:" in capsys.readouterr().err


def test_bar_ratios_take_the_best_other_policy():
    table = [
        {
            "policy": "a",
            "ttft_p90_s": 2.0,
            "goodput_rps": 5.0,
            "hit_ratio": 0.1,
            "hit_ratio_bound": 0.4,
        },
        {
            "policy": "b",
            "ttft_p90_s": 1.0,
            "goodput_rps": 4.0,
            "hit_ratio": 0.2,
            "hit_ratio_bound": 0.4,
        },
        {
            "policy": "once",
            "ttft_p90_s": 0.5,
            "goodput_rps": 6.0,
            "hit_ratio": 0.3,
            "hit_ratio_bound": 0.4,
        },
    ]
    ratios = bar_ratios(table)
    assert ratios["p90_ttft_ratio_vs_best"] == 0.5 and ratios["best_other_p90_ttft_policy"] == "b"
    assert ratios["goodput_ratio_vs_best"] == 1.2 and ratios["best_other_goodput_policy"] == "a"
    assert ratios["hit_ratio_vs_bound"] == pytest.approx(0.75)
    assert bar_ratios(table[:2]) == {}


def test_compare_refuses_an_empty_trace_and_unknown_policies():
    scenario = Scenario(make_profile(), num_replicas=2)
    with pytest.raises(ValueError):
        compare_policies([], scenario, ["once"])
    requests = [make_request("a", 0.0, (1,)), make_request("b", 1.0, (1,))]
    with pytest.raises(ValueError, match="unknown routing policies"):
        compare_policies(requests, scenario, ["fastest"])
