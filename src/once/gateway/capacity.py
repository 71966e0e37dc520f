"""CPU-aware capacity: what a request costs this gateway's CPU, reported so a balancer can
weight replicas by it, and a planner that turns measured costs into replica counts.

- `CpuCostMeter` times the gateway's CPU stages (render, tokenize, detokenize, and
  `request`: the request's whole gateway CPU, those three stages included) with
  `time.thread_time()` of the thread doing the work. Per-1k-token figures are
  token-weighted decayed averages: decayed CPU over decayed tokens, both decayed with one
  wall-clock half-life. Big requests count more than small ones, and idle time leaves the
  ratio alone. `half_life_s=None` keeps plain totals since start.
- The load report goes out as the ORCA `endpoint-load-metrics` TEXT header
  (`TEXT cpu_utilization=0.31, rps_fractional=12.5, named_metrics.inflight=3, ...`), the
  format Envoy and vLLM use, so an ORCA-aware balancer can weight by it unchanged.
- `plan_capacity` works out each CPU model's requests/s per replica (cores x 1000 ms x
  max_utilization / CPU ms per request). It fills the target cheapest first (fewest CPU ms
  per request, so the fewest core-hours) and weights replicas by their capacity.
"""

import argparse
import json
import math
import os
import platform
import sys
import threading
import time
import tomllib
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import prometheus_client

from once.protocol.errors import InvalidRequestError, OnceError

STAGES = ("render", "tokenize", "detokenize", "request")
LOAD_REPORT_HEADER = "endpoint-load-metrics"  # ORCA's name; Envoy and vLLM read and write it
HEADER_NAMED_METRICS = ("inflight", "cores", "render_ms_per_1k", "tokenize_ms_per_1k")
HEADER_NAMED_METRICS += ("detokenize_ms_per_1k", "request_ms", "cpu_ms_per_request")
MIN_DECAY_FACTOR = 1e-9  # after a long idle spell old data fades out but never underflows to 0/0


def cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                key, sep, value = line.partition(":")
                if sep and key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def usable_cores() -> float:
    """CPUs this process may use: its affinity mask, capped by a cgroup CPU quota."""
    try:
        cores = float(len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        cores = float(os.cpu_count() or 1)
    quota = _cgroup_cpu_quota()
    return min(cores, quota) if quota else cores


def _cgroup_cpu_quota() -> float | None:
    # cgroup v2 cpu.max holds "max 100000" or "150000 100000"; v1 has quota -1 when unlimited.
    try:
        v2 = Path("/sys/fs/cgroup/cpu.max")
        if v2.exists():
            quota, period = v2.read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        v1 = Path("/sys/fs/cgroup/cpu")
        quota_us = int((v1 / "cpu.cfs_quota_us").read_text())
        period_us = int((v1 / "cpu.cfs_period_us").read_text())
        return quota_us / period_us if quota_us > 0 and period_us > 0 else None
    except (OSError, ValueError):
        return None


@dataclass
class StageMeasurement:
    # Yielded by `measure()`: set `num_tokens` inside the block when it is known only then
    # (tokenize); cpu_s and wall_s are filled in when the block exits.
    stage: str
    num_tokens: int
    cpu_s: float = 0.0
    wall_s: float = 0.0


class CpuCostMeter:
    """CPU cost of the gateway's stages, exported to Prometheus and as a load report.

    Every request must produce exactly one "request" record, with all the gateway CPU it
    cost (its render, tokenize and detokenize CPU included): that record is how the meter
    counts requests. So never sum the stages of once_gateway_cpu_seconds_total.
    """

    def __init__(
        self,
        registry: prometheus_client.CollectorRegistry | None = None,
        *,
        half_life_s: float | None = 120.0,
        utilization_window_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        cpu_model: str | None = None,
        cores: float | None = None,
    ):
        if half_life_s is not None and half_life_s <= 0:
            raise ValueError("half_life_s must be > 0 (or None for totals since start)")
        if cores is not None and cores <= 0:
            raise ValueError(f"cores must be > 0, got {cores}")
        self.registry = registry if registry is not None else prometheus_client.CollectorRegistry()
        self.cpu_model = cpu_model or cpu_model_name()
        self.cores = cores or usable_cores()
        self._half_life_s = half_life_s
        self._clock = clock
        self._lock = threading.Lock()  # stages run on the event loop and in worker threads
        self._cpu_s = dict.fromkeys(STAGES, 0.0)  # decayed sums
        self._num_tokens = dict.fromkeys(STAGES, 0.0)
        self._num_requests = 0.0
        self._num_requests_total = 0  # not decayed: the requests/s window counts these
        self._last_decay = clock()
        # The utilization window: process CPU and request count at its start.
        self._window_s = utilization_window_s
        self._window_start = self._last_decay
        self._window_cpu_s = time.process_time()
        self._window_requests = 0
        self._cpu_utilization = 0.0
        self._requests_per_s = 0.0

        def metric(kind, name, doc, labels=()):
            return kind(name, doc, labels, registry=self.registry)

        Counter, Gauge = prometheus_client.Counter, prometheus_client.Gauge
        self._cpu_seconds = metric(
            Counter,
            "once_gateway_cpu_seconds",
            "Gateway CPU time by stage (request includes the other stages)",
            ["stage"],
        )
        self._wall_seconds = metric(
            Counter, "once_gateway_wall_seconds", "Wall time of measured stages", ["stage"]
        )
        self._stage_tokens = metric(
            Counter, "once_gateway_stage_tokens", "Tokens processed by stage", ["stage"]
        )
        self._ms_per_1k = metric(
            Gauge, "once_gateway_cpu_ms_per_1k_tokens", "Decayed CPU ms per 1k tokens", ["stage"]
        )
        self._ms_per_request = metric(
            Gauge, "once_gateway_cpu_ms_per_request", "Decayed gateway CPU ms per request"
        )
        cpu_info = metric(
            Gauge, "once_gateway_cpu_info", "CPU this gateway runs on", ["cpu_model", "cores"]
        )
        cpu_info.labels(cpu_model=self.cpu_model, cores=_format_number(self.cores)).set(1)
        for stage in STAGES:  # export every stage from the start, at 0
            for family in (self._cpu_seconds, self._wall_seconds, self._stage_tokens):
                family.labels(stage=stage)
            self._ms_per_1k.labels(stage=stage).set(0)

    @contextmanager
    def measure(self, stage: str, num_tokens: int = 0):
        # thread_time() counts only the calling thread: wrap synchronous work where it runs
        # (inside the worker thread), never a block that awaits.
        _check_stage(stage)
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        measurement = StageMeasurement(stage, num_tokens)
        cpu_start, wall_start = time.thread_time(), time.perf_counter()
        try:
            yield measurement
        finally:  # CPU spent on work that then failed was spent all the same
            measurement.cpu_s = time.thread_time() - cpu_start
            measurement.wall_s = time.perf_counter() - wall_start
            self.record(stage, measurement.cpu_s, measurement.num_tokens, measurement.wall_s)

    def record(self, stage: str, cpu_s: float, num_tokens: int, wall_s: float = 0.0) -> None:
        _check_stage(stage)
        if cpu_s < 0 or num_tokens < 0 or wall_s < 0:
            raise ValueError(f"cpu_s, num_tokens and wall_s must be >= 0 (stage {stage!r})")
        with self._lock:
            self._decay(self._clock())
            self._cpu_s[stage] += cpu_s
            self._num_tokens[stage] += num_tokens
            if stage == "request":
                self._num_requests += 1
                self._num_requests_total += 1
            self._cpu_seconds.labels(stage=stage).inc(cpu_s)
            self._wall_seconds.labels(stage=stage).inc(wall_s)
            self._stage_tokens.labels(stage=stage).inc(num_tokens)
            self._ms_per_1k.labels(stage=stage).set(self._ms_per_1k_locked(stage))
            self._ms_per_request.set(self._ms_per_request_locked())

    def cost_per_1k_tokens(self) -> dict[str, float]:
        """Stage -> decayed CPU ms per 1k tokens (0.0 for a stage with no tokens yet)."""
        with self._lock:
            return {stage: self._ms_per_1k_locked(stage) for stage in STAGES}

    def cpu_ms_per_request(self) -> float:
        """The "request" stage: all gateway CPU per request, decayed."""
        with self._lock:
            return self._ms_per_request_locked()

    def request_overhead_ms(self) -> float:
        """CPU per request outside the three token stages: the planner's fixed cost.

        Total request CPU minus the token stages' CPU, per request. Requests still in
        flight have recorded stages but no request yet, which can only lower the figure,
        so it is clamped at 0."""
        with self._lock:
            stages_cpu_s = sum(self._cpu_s[stage] for stage in STAGES[:3])
            overhead_ms = (self._cpu_s["request"] - stages_cpu_s) * 1000
            return max(0.0, _ratio(overhead_ms, self._num_requests))

    def load_report(self, inflight: int) -> dict:
        costs = self.cost_per_1k_tokens()
        cpu_utilization, requests_per_s = self._sample_window()
        return {
            "cpu_model": self.cpu_model,
            "cores": self.cores,
            "inflight": inflight,
            "render_ms_per_1k": costs["render"],
            "tokenize_ms_per_1k": costs["tokenize"],
            "detokenize_ms_per_1k": costs["detokenize"],
            "request_ms": self.request_overhead_ms(),
            "cpu_ms_per_request": self.cpu_ms_per_request(),
            "cpu_utilization": cpu_utilization,
            "rps": requests_per_s,
        }

    def load_report_header(self, inflight: int) -> str:
        """The value of the `endpoint-load-metrics` header (ORCA TEXT; numbers only, so the
        CPU model name travels in /metrics as once_gateway_cpu_info)."""
        report = self.load_report(inflight)
        fields = [
            f"cpu_utilization={_format_number(report['cpu_utilization'])}",
            f"rps_fractional={_format_number(report['rps'])}",
        ]
        fields += [f"named_metrics.{k}={_format_number(report[k])}" for k in HEADER_NAMED_METRICS]
        return "TEXT " + ", ".join(fields)

    def fleet_entry(self, available: int = 1) -> dict:
        """This gateway as one `[[cpu]]` entry of a fleet file, for `plan_capacity`."""
        costs = {**self.cost_per_1k_tokens(), "request": self.request_overhead_ms()}
        return {
            "cpu_model": self.cpu_model,
            "cores": self.cores,
            "available": available,
            "costs": costs,
        }

    # -- internals ----------------------------------------------------------------------

    def _decay(self, now: float) -> None:
        # Scale every sum by the same factor: each ratio stays put between records, so the
        # read methods need not decay.
        elapsed = now - self._last_decay
        if self._half_life_s is None or elapsed <= 0:
            return
        factor = max(0.5 ** (elapsed / self._half_life_s), MIN_DECAY_FACTOR)
        for stage in STAGES:
            self._cpu_s[stage] *= factor
            self._num_tokens[stage] *= factor
        self._num_requests *= factor
        self._last_decay = now

    def _ms_per_1k_locked(self, stage: str) -> float:
        return _ratio(self._cpu_s[stage] * 1e6, self._num_tokens[stage])  # s/token -> ms/1k

    def _ms_per_request_locked(self) -> float:
        return _ratio(self._cpu_s["request"] * 1000, self._num_requests)

    def _sample_window(self) -> tuple[float, float]:
        # ORCA wants the latest sample. Take process CPU (all threads) as a fraction of the
        # usable cores, and requests/s, over the last window that ran >= utilization_window_s.
        # Calls in between return that window's figures.
        now, process_cpu_s = self._clock(), time.process_time()
        with self._lock:
            elapsed = now - self._window_start
            if elapsed >= self._window_s and elapsed > 0:
                self._cpu_utilization = (process_cpu_s - self._window_cpu_s) / (
                    elapsed * self.cores
                )
                self._requests_per_s = (self._num_requests_total - self._window_requests) / elapsed
                self._window_start, self._window_cpu_s = now, process_cpu_s
                self._window_requests = self._num_requests_total
            return self._cpu_utilization, self._requests_per_s


def parse_load_report_header(value: str) -> dict[str, float]:
    """Read a TEXT `endpoint-load-metrics` value back; `named_metrics.` prefixes dropped."""
    fmt, _, body = value.strip().partition(" ")
    if fmt != "TEXT":
        raise ValueError(f"not an ORCA TEXT load report: {value!r}")
    metrics = {}
    for field in body.split(","):
        key, sep, number = field.strip().partition("=")
        if not sep or not key:
            raise ValueError(f"malformed load report field {field!r}")
        metrics[key.removeprefix("named_metrics.")] = float(number)
    return metrics


# -- planner ------------------------------------------------------------------------------

COST_KEYS = ("render", "tokenize", "detokenize", "request")
CPU_KEYS = ("cpu_model", "cores", "available", "costs")


def request_cpu_ms(costs: dict, new_prompt_tokens: float, output_tokens: float) -> float:
    # Render and tokenize scale with the *new* prompt tokens (a continuation sends only its
    # new items), detokenize with the output tokens; "request" is a fixed cost per request.
    token_ms = (costs["render"] + costs["tokenize"]) * new_prompt_tokens
    token_ms += costs["detokenize"] * output_tokens
    return token_ms / 1000 + costs["request"]


def plan_capacity(fleet: list[dict], target: dict) -> dict:
    """Replica counts and balancer weights that serve `target` with the fewest core-hours.

    Greedy, cheapest first: CPU models in order of CPU ms per request (ties: more capacity
    per replica first), each taking replicas (up to `available`) until the target is met.
    Weights are integers proportional to per-replica capacity, 100 for the largest in use
    and 0 for models not used. Ready for nginx, HAProxy or Envoy endpoint weights.
    """
    rps, new_prompt_tokens, output_tokens, max_utilization = _check_target(target)
    if not isinstance(fleet, list) or not fleet:
        raise InvalidRequestError("the fleet lists no CPUs", param="fleet")
    rows = []
    for index, entry in enumerate(fleet):
        cpu = _check_cpu(entry, index)
        ms = request_cpu_ms(cpu["costs"], new_prompt_tokens, output_tokens)
        if ms <= 0:
            raise InvalidRequestError(
                f"fleet[{index}] ({cpu['cpu_model']}): costs are all zero for this target, "
                "so its capacity would be unbounded",
                param=f"fleet[{index}].costs",
            )
        capacity = cpu["cores"] * 1000 * max_utilization / ms
        rows.append({**cpu, "cpu_ms_per_request": ms, "capacity_rps": capacity})

    rows.sort(key=lambda row: (row["cpu_ms_per_request"], -row["capacity_rps"]))
    remaining = rps
    for row in rows:
        # The epsilon keeps float noise (2.0000000001 replicas) from adding a replica.
        needed = math.ceil(remaining / row["capacity_rps"] - 1e-9) if remaining > 0 else 0
        row["count"] = min(row["available"], max(needed, 0))
        remaining -= row["count"] * row["capacity_rps"]

    used = [row["capacity_rps"] for row in rows if row["count"] > 0]
    largest = max(used, default=1.0)
    total = sum(row["count"] * row["capacity_rps"] for row in rows)
    replicas = [
        {
            "cpu_model": row["cpu_model"],
            "cores": row["cores"],
            "count": row["count"],
            "available": row["available"],
            "cpu_ms_per_request": row["cpu_ms_per_request"],
            "capacity_rps": row["capacity_rps"],
            "weight": max(1, round(100 * row["capacity_rps"] / largest)) if row["count"] else 0,
        }
        for row in rows
    ]
    meets_target = total >= rps * (1 - 1e-9)
    return {
        "replicas": replicas,
        "total_capacity_rps": total,
        "target_rps": rps,
        "meets_target": meets_target,
        "shortfall_rps": 0.0 if meets_target else rps - total,
        # With weights proportional to capacity every replica runs at the same utilization.
        "expected_utilization": max_utilization * rps / total if total > 0 else None,
    }


def _check_target(target: dict) -> tuple[float, float, float, float]:
    if not isinstance(target, dict):
        raise InvalidRequestError("the target must be a table of numbers", param="target")
    rps = _number(target.get("requests_per_s"), "target.requests_per_s", positive=True)
    new_prompt = _number(target.get("new_prompt_tokens"), "target.new_prompt_tokens")
    output = _number(target.get("output_tokens"), "target.output_tokens")
    utilization = _number(
        target.get("max_utilization", 0.7), "target.max_utilization", positive=True
    )
    if utilization > 1:
        raise InvalidRequestError(
            f"target.max_utilization must be in (0, 1], got {utilization}",
            param="target.max_utilization",
        )
    return rps, new_prompt, output, utilization


def _check_cpu(entry: dict, index: int) -> dict:
    where = f"fleet[{index}]"
    if not isinstance(entry, dict):
        raise InvalidRequestError(f"{where} must be a table", param=where)
    unknown = sorted(set(entry) - set(CPU_KEYS))
    missing = [key for key in CPU_KEYS if key not in entry]
    if unknown or missing:
        problems = [f"missing {', '.join(missing)}"] if missing else []
        problems += [f"unknown {', '.join(unknown)}"] if unknown else []
        raise InvalidRequestError(f"{where}: {'; '.join(problems)}", param=where)
    cpu_model = entry["cpu_model"]
    if not isinstance(cpu_model, str) or not cpu_model.strip():
        raise InvalidRequestError(f"{where}.cpu_model must be a name", param=f"{where}.cpu_model")
    available = entry["available"]
    if isinstance(available, bool) or not isinstance(available, int) or available < 0:
        raise InvalidRequestError(
            f"{where}.available must be a whole number >= 0, got {available!r}",
            param=f"{where}.available",
        )
    costs = entry["costs"]
    if not isinstance(costs, dict) or set(costs) != set(COST_KEYS):
        raise InvalidRequestError(
            f"{where}.costs must have exactly {', '.join(COST_KEYS)}, got "
            f"{sorted(costs) if isinstance(costs, dict) else type(costs).__name__}",
            param=f"{where}.costs",
        )
    return {
        "cpu_model": cpu_model.strip(),
        "cores": _number(entry["cores"], f"{where}.cores", positive=True),
        "available": available,
        "costs": {key: _number(costs[key], f"{where}.costs.{key}") for key in COST_KEYS},
    }


def _number(value, param: str, positive: bool = False) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise InvalidRequestError(f"{param} must be a number {bound}, got {value!r}", param=param)
    return float(value)


def _check_stage(stage: str) -> None:
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; expected one of {', '.join(STAGES)}")


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator > 0 else 0.0


def _format_number(value: float) -> str:
    # Fixed point with trailing zeros dropped ("2", "0.3125"): no exponent notation, which
    # not every header parser takes.
    text = f"{value:.4f}".rstrip("0").rstrip(".")
    return "0" if text in ("", "-0") else text


# -- measuring this machine ---------------------------------------------------------------


def measure_tokenizer_costs(tokenizer, *, num_rounds: int = 30) -> CpuCostMeter:
    """Run the gateway's stages on a synthetic agent turn with a Hugging Face tokenizer.

    render = the chat template, tokenize = encoding the rendered prompt, detokenize = a
    `DecodeStream` over a 400-token answer, request = parsing the request body and encoding
    an SSE delta event per output token plus the final response. That last one is a floor
    for the rest of the pipeline: a gateway under real load reports the true figure.
    """
    from tokenizers.decoders import DecodeStream

    backend = tokenizer.backend_tokenizer
    tool_output = "\n".join(
        f"src/module_{i}.py:{i * 7}: def handler_{i}(request):" for i in range(40)
    )
    messages = [
        {"role": "system", "content": "You are a coding agent. Use the shell tool. " * 8},
        {"role": "user", "content": "Find where requests are handled and add a timeout."},
        {"role": "assistant", "content": "I will search the code for handlers first."},
        {"role": "user", "content": tool_output},
    ]
    answer_ids = tokenizer.encode(tool_output * 2, add_special_tokens=False)[:400]
    body = json.dumps({"model": "m", "input": messages, "tools": [], "store": True})
    prompt = tokenizer.apply_chat_template(messages, tokenize=False)
    num_prompt_tokens = len(tokenizer.encode(prompt, add_special_tokens=False))
    num_tokens = num_prompt_tokens + len(answer_ids)
    meter = CpuCostMeter(half_life_s=None)
    for round_index in range(num_rounds + 3):
        sink = meter if round_index >= 3 else CpuCostMeter(half_life_s=None)  # 3 warm-ups
        # "request" encloses the three stages: it is the request's whole CPU.
        with sink.measure("request", num_tokens):
            json.loads(body)
            with sink.measure("render", num_prompt_tokens):
                prompt = tokenizer.apply_chat_template(messages, tokenize=False)
            with sink.measure("tokenize", num_prompt_tokens):
                tokenizer.encode(prompt, add_special_tokens=False)
            with sink.measure("detokenize", len(answer_ids)):
                stream = DecodeStream(skip_special_tokens=True)
                pieces = [stream.step(backend, token_id) or "" for token_id in answer_ids]
            for piece in pieces:
                event = {"type": "response.output_text.delta", "item_id": "msg", "delta": piece}
                f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()
            json.dumps({"id": "resp", "output": [{"type": "message", "content": "".join(pieces)}]})
    return meter


def _fleet_entry_toml(entry: dict) -> str:
    costs = entry["costs"]
    lines = [
        "[[cpu]]",
        f"cpu_model = {json.dumps(entry['cpu_model'])}",
        f"cores = {_format_number(entry['cores'])}",
        f"available = {entry['available']}",
        "[cpu.costs]  # CPU ms per 1k tokens; request: ms per request",
    ]
    lines += [f"{key} = {_format_number(costs[key])}" for key in COST_KEYS]
    return "\n".join(lines)


# -- once capacity --------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """`once capacity`: 0 when the fleet meets the target, 1 when it falls short, 2 on bad
    input (a message on stderr, no traceback)."""
    parser = argparse.ArgumentParser(
        prog="once capacity",
        description="Replica counts and balancer weights for a fleet of gateway CPUs.",
    )
    parser.add_argument("--fleet", type=Path, help="TOML file of [[cpu]] entries")
    parser.add_argument("--rps", type=float, help="target requests per second")
    parser.add_argument("--new-prompt-tokens", type=float, help="new prompt tokens per request")
    parser.add_argument("--output-tokens", type=float, help="output tokens per request")
    parser.add_argument("--max-utilization", type=float, default=0.7)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument(
        "--measure",
        metavar="MODEL",
        help="measure this machine with MODEL's tokenizer; print its [[cpu]] entry",
    )
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # usage errors (2) and --help (0) without leaving main
        return exit_.code if isinstance(exit_.code, int) else 2
    try:
        if args.measure:
            from once.engine.loader import load_tokenizer, resolve_model_path

            tokenizer = load_tokenizer(resolve_model_path(args.measure))
            print(_fleet_entry_toml(measure_tokenizer_costs(tokenizer).fleet_entry()))
            return 0
        needed = {"--fleet": args.fleet, "--rps": args.rps}
        needed |= {"--new-prompt-tokens": args.new_prompt_tokens}
        needed |= {"--output-tokens": args.output_tokens}
        if missing := [flag for flag, value in needed.items() if value is None]:
            raise InvalidRequestError(f"missing {', '.join(missing)} (or use --measure MODEL)")
        fleet = _read_fleet(args.fleet)
        target = {
            "requests_per_s": args.rps,
            "new_prompt_tokens": args.new_prompt_tokens,
            "output_tokens": args.output_tokens,
            "max_utilization": args.max_utilization,
        }
        plan = plan_capacity(fleet, target)
    except OnceError as exc:
        print(f"once capacity: {exc.message}", file=sys.stderr)
        return 2
    print(json.dumps(plan, indent=2) if args.json else _format_plan(plan, target))
    return 0 if plan["meets_target"] else 1


def _read_fleet(path: Path) -> list:
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"cannot read fleet file {str(path)!r}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise InvalidRequestError(f"fleet file {str(path)!r} is not valid TOML: {exc}") from exc
    fleet = document.get("cpu")
    if not isinstance(fleet, list) or not fleet:
        raise InvalidRequestError(f"fleet file {str(path)!r} has no [[cpu]] entries")
    return fleet


def _format_plan(plan: dict, target: dict) -> str:
    width = max(len("cpu_model"), *(len(row["cpu_model"]) for row in plan["replicas"]))
    lines = [
        f"target: {target['requests_per_s']:g} req/s, {target['new_prompt_tokens']:g} new prompt"
        f" + {target['output_tokens']:g} output tokens per request, CPU utilization <= "
        f"{target['max_utilization']:.0%}",
        f"{'cpu_model':<{width}}  cores    ms/req  req/s each  count/avail  weight",
    ]
    for row in plan["replicas"]:
        lines.append(
            f"{row['cpu_model']:<{width}}  {row['cores']:>5g}  {row['cpu_ms_per_request']:>8.3f}"
            f"  {row['capacity_rps']:>10.1f}  {row['count']:>5}/{row['available']:<5}"
            f"  {row['weight']:>6}"
        )
    total = f"total capacity {plan['total_capacity_rps']:.1f} req/s"
    if plan["meets_target"]:
        utilization = plan["expected_utilization"]
        lines.append(f"{total}: meets the target; expected CPU utilization {utilization:.0%}")
    else:
        lines.append(f"{total}: SHORT of the target by {plan['shortfall_rps']:.1f} req/s")
    return "\n".join(lines)
