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

import os
import platform
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import prometheus_client

from once.cpus import cpu_quota

STAGES = ("render", "tokenize", "detokenize", "request")
LOAD_REPORT_HEADER = "endpoint-load-metrics"  # ORCA's name; Envoy and vLLM read and write it
HEADER_NAMED_METRICS = (
    "inflight",
    "cores",
    "render_ms_per_1k",
    "tokenize_ms_per_1k",
    "detokenize_ms_per_1k",
    "request_ms",
    "cpu_ms_per_request",
)
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
    quota = cpu_quota()
    return min(cores, quota) if quota else cores


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
        # Calls in between return that window's figures, without reading the process CPU
        # clock: summing every thread's CPU time costs ~0.5 ms a read in this VM, and the
        # header is built for every request.
        now = self._clock()
        with self._lock:
            elapsed = now - self._window_start
            if elapsed >= self._window_s and elapsed > 0:
                process_cpu_s = time.process_time()
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
