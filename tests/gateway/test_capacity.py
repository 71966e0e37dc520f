import json
import threading
import time
import tomllib
from pathlib import Path

import prometheus_client
import pytest

from once.gateway.admission import capacity, capacity_plan
from once.gateway.admission.capacity import (
    CpuCostMeter,
    cpu_model_name,
    parse_load_report_header,
    usable_cores,
)
from once.gateway.admission.capacity_plan import main, measure_tokenizer_costs, plan_capacity
from once.protocol.errors import InvalidRequestError

EXAMPLE_FLEET = Path(__file__).resolve().parents[2] / "examples" / "fleet.toml"


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def burn_cpu(seconds: float) -> None:
    deadline = time.thread_time() + seconds
    while time.thread_time() < deadline:
        sum(i * i for i in range(1000))


def make_meter(**kwargs) -> CpuCostMeter:
    return CpuCostMeter(cpu_model="Test CPU 9000", cores=2, **kwargs)


# -- the meter ----------------------------------------------------------------------------


def test_meter_accumulates_and_computes_per_1k_figures():
    meter = make_meter(half_life_s=None)
    meter.record("render", 0.002, 1000)
    meter.record("render", 0.004, 3000)  # (2 + 4) ms over 4k tokens: 1.5 ms per 1k
    meter.record("tokenize", 0.003, 2000)
    meter.record("detokenize", 0.0005, 250)
    # Each request record holds that request's whole CPU, its stages included.
    meter.record("request", 0.010, 3000)
    meter.record("request", 0.004, 0)

    costs = meter.cost_per_1k_tokens()
    assert costs["render"] == pytest.approx(1.5)
    assert costs["tokenize"] == pytest.approx(1.5)
    assert costs["detokenize"] == pytest.approx(2.0)
    assert meter.cpu_ms_per_request() == pytest.approx(7.0)  # (10 + 4) ms over 2 requests
    # What the stages do not explain: (14 - (6 + 3 + 0.5)) ms over 2 requests.
    assert meter.request_overhead_ms() == pytest.approx(2.25)

    entry = meter.fleet_entry(available=3)
    assert entry["costs"] == pytest.approx(
        {"render": 1.5, "tokenize": 1.5, "detokenize": 2.0, "request": 2.25}
    )
    assert (entry["cpu_model"], entry["cores"], entry["available"]) == ("Test CPU 9000", 2, 3)


def test_empty_meter_reports_zeros():
    meter = make_meter()
    assert meter.cost_per_1k_tokens() == dict.fromkeys(capacity.STAGES, 0.0)
    assert meter.cpu_ms_per_request() == 0.0


def test_request_overhead_is_never_negative():
    # A request still in flight has recorded its render but not yet its request record.
    meter = make_meter(half_life_s=None)
    meter.record("render", 0.005, 1000)
    meter.record("request", 0.001, 1000)
    assert meter.request_overhead_ms() == 0.0
    assert meter.cpu_ms_per_request() == pytest.approx(1.0)


def test_decayed_average_weighs_recent_work_and_ignores_idle_time():
    clock = FakeClock()
    meter = make_meter(half_life_s=10.0, clock=clock)
    meter.record("render", 0.010, 1000)  # 10 ms per 1k
    clock.now += 10  # one half-life: the old record now weighs 5 ms over 500 tokens
    meter.record("render", 0.001, 1000)  # 1 ms per 1k
    assert meter.cost_per_1k_tokens()["render"] == pytest.approx((5 + 1) / 1.5)

    clock.now += 1000  # idle: the ratio does not drift
    assert meter.cost_per_1k_tokens()["render"] == pytest.approx(4.0)

    clock.now += 1e9  # a very long idle spell: old data fades out but nothing divides 0/0
    meter.record("render", 0.002, 1000)
    assert meter.cost_per_1k_tokens()["render"] == pytest.approx(2.0, rel=1e-6)


def test_measure_records_cpu_of_real_work():
    meter = make_meter(half_life_s=None)
    with meter.measure("tokenize") as measurement:
        burn_cpu(0.03)
        measurement.num_tokens = 600  # known only once the work is done
    assert measurement.cpu_s >= 0.03
    assert measurement.wall_s >= measurement.cpu_s * 0.5
    assert meter.cost_per_1k_tokens()["tokenize"] == pytest.approx(measurement.cpu_s * 1e6 / 600)


def test_measure_records_almost_no_cpu_for_a_sleep():
    meter = make_meter(half_life_s=None)
    with meter.measure("render", 100) as measurement:
        time.sleep(0.05)
    assert measurement.wall_s >= 0.045
    assert measurement.cpu_s < 0.01
    assert meter.cost_per_1k_tokens()["render"] < 100  # < 10 ms over 100 tokens


def test_measure_counts_only_the_thread_doing_the_work():
    meter = make_meter(half_life_s=None)
    results = {}

    def sleeping_worker():
        with meter.measure("detokenize", 10) as measurement:
            time.sleep(0.08)
        results["sleeping"] = measurement.cpu_s

    def busy_worker():
        with meter.measure("render", 10) as measurement:
            burn_cpu(0.03)
        results["busy"] = measurement.cpu_s

    sleeper = threading.Thread(target=sleeping_worker)
    sleeper.start()
    burn_cpu(0.04)  # this thread's CPU must not land on the sleeping worker's stage
    sleeper.join()
    busy = threading.Thread(target=busy_worker)
    busy.start()
    busy.join()
    assert results["sleeping"] < 0.015
    assert results["busy"] >= 0.03


def test_measure_records_work_that_raised():
    meter = make_meter(half_life_s=None)
    with pytest.raises(RuntimeError), meter.measure("render", 50):
        burn_cpu(0.01)
        raise RuntimeError("template failed")
    assert meter.cost_per_1k_tokens()["render"] > 0


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.record("parse", 0.1, 10),
        lambda m: m.record("render", -0.1, 10),
        lambda m: m.record("render", 0.1, -1),
        lambda m: m.measure("nope", 1).__enter__(),
        lambda m: m.measure("render", -5).__enter__(),
        lambda m: CpuCostMeter(half_life_s=0),
    ],
)
def test_meter_rejects_bad_input(call):
    with pytest.raises(ValueError):
        call(make_meter())


def test_metrics_text_has_the_families_and_labels():
    registry = prometheus_client.CollectorRegistry()
    meter = CpuCostMeter(registry, half_life_s=None, cpu_model="Test CPU 9000", cores=2)
    meter.record("render", 0.003, 2000, wall_s=0.004)
    meter.record("request", 0.005, 0)
    text = prometheus_client.generate_latest(registry).decode()

    assert 'once_gateway_cpu_seconds_total{stage="render"} 0.003' in text
    assert 'once_gateway_stage_tokens_total{stage="render"} 2000.0' in text
    assert 'once_gateway_wall_seconds_total{stage="render"} 0.004' in text
    assert 'once_gateway_cpu_ms_per_1k_tokens{stage="render"} 1.5' in text
    assert 'once_gateway_cpu_ms_per_1k_tokens{stage="detokenize"} 0.0' in text
    assert "once_gateway_cpu_ms_per_request 5.0" in text
    assert 'once_gateway_cpu_info{cores="2",cpu_model="Test CPU 9000"} 1.0' in text
    for stage in capacity.STAGES:  # every stage is exported from the start
        assert f'once_gateway_cpu_seconds_total{{stage="{stage}"}}' in text


def test_meters_use_private_registries_by_default():
    first, second = make_meter(), make_meter()  # would collide on one shared registry
    assert first.registry is not second.registry
    default_text = prometheus_client.generate_latest(prometheus_client.REGISTRY).decode()
    assert "once_gateway_cpu" not in default_text


def test_load_report_and_header_parse_back():
    clock = FakeClock()
    meter = make_meter(half_life_s=None, clock=clock, utilization_window_s=2.0)
    meter.record("render", 0.001, 1000)
    meter.record("tokenize", 0.002, 1000)
    meter.record("detokenize", 0.0005, 1000)
    for _ in range(10):
        meter.record("request", 0.0005, 100)

    before_window = meter.load_report(inflight=4)
    assert before_window["rps"] == 0.0  # the first window has not run its course yet
    clock.now += 2.0
    report = meter.load_report(inflight=4)
    assert report["cpu_model"] == "Test CPU 9000"
    assert report["cores"] == 2
    assert report["inflight"] == 4
    assert report["rps"] == pytest.approx(5.0)  # 10 requests over the 2 s window
    assert report["cpu_utilization"] >= 0
    assert report["render_ms_per_1k"] == pytest.approx(1.0)
    assert report["cpu_ms_per_request"] == pytest.approx(0.5)  # 5 ms over 10 requests
    assert report["request_ms"] == pytest.approx(0.15)  # (5 - (1 + 2 + 0.5)) ms / 10

    header = meter.load_report_header(inflight=4)
    assert header.startswith("TEXT cpu_utilization=")
    assert "named_metrics.tokenize_ms_per_1k=2," in header
    assert "e-" not in header  # fixed point only
    parsed = parse_load_report_header(header)
    assert parsed["rps_fractional"] == pytest.approx(5.0)
    assert parsed["inflight"] == 4
    for key in capacity.HEADER_NAMED_METRICS:
        assert parsed[key] == pytest.approx(report[key], abs=1e-4)


def test_utilization_measures_process_cpu_over_the_window():
    clock = FakeClock()
    meter = make_meter(clock=clock, utilization_window_s=1.0)
    burn_cpu(0.05)
    clock.now += 1.0
    utilization = meter.load_report(0)["cpu_utilization"]
    assert 0.05 / 2 <= utilization < 0.5  # >= 50 ms of CPU over 1 s on 2 cores


@pytest.mark.parametrize("value", ["JSON {}", "TEXT a=1, b", "TEXT a=x", "TEXT =1"])
def test_parse_load_report_header_rejects_garbage(value):
    with pytest.raises(ValueError):
        parse_load_report_header(value)


def test_cpu_model_name_and_cores():
    assert cpu_model_name().strip()
    assert usable_cores() > 0


def test_cpu_model_name_without_proc_cpuinfo(monkeypatch):
    def unreadable(*args, **kwargs):
        raise OSError("no /proc here")

    monkeypatch.setattr(capacity, "open", unreadable, raising=False)
    monkeypatch.setattr(capacity.platform, "processor", lambda: "")
    assert cpu_model_name() == "unknown"
    monkeypatch.setattr(capacity.platform, "processor", lambda: "arm64")
    assert cpu_model_name() == "arm64"


# -- the planner --------------------------------------------------------------------------

# With 1000 new prompt tokens and 500 output tokens per request:
#   fast: (1 + 1) * 1 + 2 * 0.5 + 1 = 4 ms per request; 4 cores * 1000 ms * 0.5 / 4 = 500 req/s
#   slow: (2 + 2) * 1 + 4 * 0.5 + 2 = 8 ms per request; 4 cores * 1000 ms * 0.5 / 8 = 250 req/s
SLOW = {
    "cpu_model": "slow",
    "cores": 4,
    "available": 10,
    "costs": {"render": 2, "tokenize": 2, "detokenize": 4, "request": 2},
}
FAST = {
    "cpu_model": "fast",
    "cores": 4,
    "available": 2,
    "costs": {"render": 1, "tokenize": 1, "detokenize": 2, "request": 1},
}


def target(rps: float, **overrides) -> dict:
    base = {
        "requests_per_s": rps,
        "new_prompt_tokens": 1000,
        "output_tokens": 500,
        "max_utilization": 0.5,
    }
    return base | overrides


def test_plan_fills_cheapest_cpu_first_and_weights_by_capacity():
    plan = plan_capacity([SLOW, FAST], target(1600))
    fast, slow = plan["replicas"]  # cheapest first, whatever the fleet's order
    assert (fast["cpu_model"], fast["cpu_ms_per_request"], fast["capacity_rps"]) == (
        "fast",
        4.0,
        500.0,
    )
    assert (slow["cpu_model"], slow["cpu_ms_per_request"], slow["capacity_rps"]) == (
        "slow",
        8.0,
        250.0,
    )
    # Both fast replicas (1000 req/s), then ceil(600 / 250) = 3 slow ones.
    assert (fast["count"], slow["count"]) == (2, 3)
    assert (fast["weight"], slow["weight"]) == (100, 50)
    assert plan["total_capacity_rps"] == pytest.approx(1750)
    assert plan["meets_target"] is True
    assert plan["shortfall_rps"] == 0.0
    assert plan["expected_utilization"] == pytest.approx(0.5 * 1600 / 1750)


def test_plan_leaves_unneeded_cpus_at_zero_weight():
    plan = plan_capacity([SLOW, FAST], target(1000))  # exactly two fast replicas
    fast, slow = plan["replicas"]
    assert (fast["count"], fast["weight"]) == (2, 100)
    assert (slow["count"], slow["weight"]) == (0, 0)
    assert plan["meets_target"] is True


def test_plan_reports_the_shortfall_of_an_insufficient_fleet():
    plan = plan_capacity([SLOW, FAST], target(5000))
    assert [row["count"] for row in plan["replicas"]] == [2, 10]  # everything available
    assert plan["total_capacity_rps"] == pytest.approx(3500)
    assert plan["meets_target"] is False
    assert plan["shortfall_rps"] == pytest.approx(1500)
    assert plan["expected_utilization"] > 0.5  # over the utilization ceiling


def test_plan_default_utilization_and_prompt_only_requests():
    plan = plan_capacity([FAST], {"requests_per_s": 10, "new_prompt_tokens": 0, "output_tokens": 0})
    # Only the fixed 1 ms per request: 4 cores * 1000 ms * 0.7 / 1 ms.
    assert plan["replicas"][0]["capacity_rps"] == pytest.approx(2800)


def with_cost(key, value):
    return FAST | {"costs": FAST["costs"] | {key: value}}


@pytest.mark.parametrize(
    "fleet, goal, param",
    [
        ([], target(10), "fleet"),
        ([with_cost("render", -1)], target(10), "fleet[0].costs.render"),
        ([with_cost("tokenize", "fast")], target(10), "fleet[0].costs.tokenize"),
        ([with_cost("detokenize", float("nan"))], target(10), "fleet[0].costs.detokenize"),
        ([FAST | {"costs": {"render": 1}}], target(10), "fleet[0].costs"),
        ([{k: v for k, v in FAST.items() if k != "cores"}], target(10), "fleet[0]"),
        ([FAST | {"colour": "blue"}], target(10), "fleet[0]"),
        ([FAST | {"cores": 0}], target(10), "fleet[0].cores"),
        ([FAST | {"available": 1.5}], target(10), "fleet[0].available"),
        ([FAST | {"available": True}], target(10), "fleet[0].available"),
        ([FAST | {"cpu_model": ""}], target(10), "fleet[0].cpu_model"),
        ([FAST], target(0), "target.requests_per_s"),
        ([FAST], target(10, output_tokens=-5), "target.output_tokens"),
        ([FAST], target(10, max_utilization=1.5), "target.max_utilization"),
        ([FAST], target(10, max_utilization=0), "target.max_utilization"),
        ([FAST], {"requests_per_s": 10}, "target.new_prompt_tokens"),
        (
            [FAST | {"costs": dict.fromkeys(capacity_plan.COST_KEYS, 0)}],
            target(10),
            "fleet[0].costs",
        ),
    ],
)
def test_plan_rejects_bad_input(fleet, goal, param):
    with pytest.raises(InvalidRequestError) as caught:
        plan_capacity(fleet, goal)
    assert caught.value.param == param


# -- once capacity ------------------------------------------------------------------------

FLEET_TOML = """
[[cpu]]
cpu_model = "slow"
cores = 4
available = 10
[cpu.costs]
render = 2
tokenize = 2
detokenize = 4
request = 2

[[cpu]]
cpu_model = "fast"
cores = 4
available = 2
[cpu.costs]
render = 1.0
tokenize = 1.0
detokenize = 2.0
request = 1.0
"""

ARGS = ["--new-prompt-tokens", "1000", "--output-tokens", "500", "--max-utilization", "0.5"]


def run_main(argv, capsys) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_main_prints_a_table(tmp_path, capsys):
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(FLEET_TOML)
    code, out, err = run_main(["--fleet", str(fleet), "--rps", "1600", *ARGS], capsys)
    assert code == 0 and err == ""
    fast_line = next(line for line in out.splitlines() if line.startswith("fast"))
    assert fast_line.split() == ["fast", "4", "4.000", "500.0", "2/2", "100"]
    assert "total capacity 1750.0 req/s: meets the target" in out


def test_main_json_matches_the_planner(tmp_path, capsys):
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(FLEET_TOML)
    code, out, _ = run_main(["--fleet", str(fleet), "--rps", "1600", "--json", *ARGS], capsys)
    assert code == 0
    expected = plan_capacity(tomllib.loads(FLEET_TOML)["cpu"], target(1600))
    assert json.loads(out) == expected


def test_main_exits_1_when_the_fleet_falls_short(tmp_path, capsys):
    fleet = tmp_path / "fleet.toml"
    fleet.write_text(FLEET_TOML)
    code, out, _ = run_main(["--fleet", str(fleet), "--rps", "5000", *ARGS], capsys)
    assert code == 1
    assert "SHORT of the target by 1500.0 req/s" in out


@pytest.mark.parametrize(
    "content, argv_tail, message",
    [
        ("[[cpu]\ncores = ", [], "not valid TOML"),
        ("title = 'no cpus'\n", [], "no [[cpu]] entries"),
        (FLEET_TOML.replace("render = 2\n", "render = -2\n"), [], "fleet[0].costs.render"),
        (FLEET_TOML.replace("available = 2\n", ""), [], "missing available"),
        (FLEET_TOML, ["--max-utilization", "2"], "max_utilization"),
        (None, [], "cannot read fleet file"),
    ],
)
def test_main_rejects_bad_input_with_exit_2(tmp_path, capsys, content, argv_tail, message):
    fleet = tmp_path / "fleet.toml"
    if content is not None:
        fleet.write_text(content)
    code, out, err = run_main(["--fleet", str(fleet), "--rps", "100", *ARGS, *argv_tail], capsys)
    assert code == 2
    assert message in err
    assert "Traceback" not in err and out == ""


@pytest.mark.parametrize(
    "argv",
    [["--rps", "100"], ["--fleet", "x.toml", "--rps", "many"], ["--bogus"]],
)
def test_main_rejects_bad_flags_with_exit_2(argv, capsys):
    code, _, err = run_main(argv, capsys)
    assert code == 2
    assert err.strip() and "Traceback" not in err


def test_example_fleet_file_plans(capsys):
    argv = ["--fleet", str(EXAMPLE_FLEET), "--rps", "2000"]
    code, out, err = run_main(
        [*argv, "--new-prompt-tokens", "300", "--output-tokens", "400"], capsys
    )
    assert code == 0, err
    models = [cpu["cpu_model"] for cpu in tomllib.loads(EXAMPLE_FLEET.read_text())["cpu"]]
    assert len(models) >= 2
    assert all(model in out for model in models)


# -- measuring a tokenizer ----------------------------------------------------------------


class WordTokenizer:
    """The three calls `measure_tokenizer_costs` makes, over a real `tokenizers` word model."""

    def __init__(self):
        from tokenizers import Tokenizer
        from tokenizers.models import WordLevel
        from tokenizers.pre_tokenizers import Whitespace

        words = "you are a coding agent use the shell tool find where requests handled".split()
        vocab = {"[UNK]": 0} | {word: i + 1 for i, word in enumerate(words)}
        self.backend_tokenizer = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
        self.backend_tokenizer.pre_tokenizer = Whitespace()

    def apply_chat_template(self, messages, tokenize=False):
        return "\n".join(f"{m['role']}: {m['content']}" for m in messages)

    def encode(self, text, add_special_tokens=False):
        return self.backend_tokenizer.encode(text).ids


def test_measure_tokenizer_costs_fills_every_stage():
    meter = measure_tokenizer_costs(WordTokenizer(), num_rounds=3)
    entry = meter.fleet_entry()
    assert all(cost > 0 for cost in entry["costs"].values()), entry
    plan = plan_capacity([entry], target(10))  # a measured entry is a valid fleet entry
    assert plan["replicas"][0]["capacity_rps"] > 0


@pytest.mark.slow
def test_measure_this_machine_with_smollm2(capsys):
    code, out, err = run_main(["--measure", "smollm2-135m-instruct"], capsys)
    assert code == 0, err
    entry = tomllib.loads(out)["cpu"][0]
    assert entry["cpu_model"] == cpu_model_name()
    assert set(entry["costs"]) == set(capacity_plan.COST_KEYS)
    assert all(cost > 0 for cost in entry["costs"].values())
