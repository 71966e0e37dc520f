"""Prometheus metrics for an engine, rendered from its `stats()` dict at scrape time.

`EngineStatsCollector` keeps the latest stats snapshot and turns it into metric families
when the registry is collected: the /metrics handler awaits `stats()` (it is async, so it
cannot run inside `collect()`), calls `update()`, then renders. Known keys get stable names
and the right type; any other numeric key is exported as a gauge `once_engine_<key>`
(nested dicts are flattened with `_`), so a new counter in the engine shows up without a
change here.

Each app owns one `EngineMetrics` with its own `CollectorRegistry`: two engine apps in one
process (tests, a router with local replicas) never collide in the global registry.
"""

import re
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from once.protocol.engine import RequestMetrics

PREFIX = "once_engine_"

# stats key -> (metric name without prefix, help). Counter names drop "_total"; the
# client library appends it.
COUNTERS = {
    "num_requests_finished": ("requests_finished", "Requests finished, any reason"),
    "num_requests_aborted": ("requests_aborted", "Requests aborted by the caller"),
    "num_prompt_tokens": ("prompt_tokens", "Prompt tokens received"),
    "num_cached_prompt_tokens": ("cached_prompt_tokens", "Prompt tokens served from cache"),
    "num_computed_prompt_tokens": ("computed_prompt_tokens", "Prompt tokens prefilled"),
    "num_generated_tokens": ("generated_tokens", "Output tokens generated"),
    "num_recomputed_tokens": ("recomputed_tokens", "Tokens prefilled again after preemption"),
    "num_preemptions": ("preemptions", "Requests preempted for lack of KV blocks"),
    "num_kv_evictions": ("kv_evictions", "Cached KV blocks evicted"),
    "prefix_cache_query_tokens": ("prefix_cache_query_tokens", "Prompt tokens looked up"),
    "prefix_cache_hit_tokens": ("prefix_cache_hit_tokens", "Prompt tokens found cached"),
    "num_steps": ("steps", "Engine steps run"),
    "step_time_s_total": ("step_time_seconds", "Time spent in engine steps"),
    "num_draft_tokens": ("draft_tokens", "Speculative tokens proposed"),
    "num_accepted_tokens": ("accepted_tokens", "Speculative tokens accepted"),
    "num_drafts": ("drafts", "Speculative verifications (decodes carrying a draft)"),
    "num_decode_forwards": ("decode_forwards", "Decode steps of requests, drafted or not"),
    "num_decode_tokens": ("decode_tokens", "Tokens committed by decode steps"),
}
# stats keys holding a list, exported as one counter labelled by position (vLLM's
# spec_decode_num_accepted_tokens_per_pos).
POSITION_COUNTERS = {
    "spec_accepted_tokens_per_position": (
        "spec_accepted_tokens_per_position",
        "Speculative tokens accepted at each draft position",
    ),
}
GAUGES = {
    "num_running": ("num_running_requests", "Requests in the running batch"),
    "num_waiting": ("num_waiting_requests", "Requests waiting to be scheduled"),
    "num_kv_blocks_used": ("kv_blocks_used", "KV cache blocks held by requests"),
    "num_kv_blocks_cached": ("kv_blocks_cached", "KV cache blocks holding a cached prefix"),
    "num_kv_blocks_free": ("kv_blocks_free", "KV cache blocks free"),
    "num_kv_blocks_total": ("kv_blocks_total", "KV cache blocks in total"),
    "prefix_cache_hit_rate": ("prefix_cache_hit_rate", "Cached / total prompt tokens"),
}

# Seconds; spans a cached short prompt on GPU to a long prefill on CPU.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


def flatten_numeric(stats: dict, prefix: str = "") -> dict[str, float]:
    """Numeric leaves of a (possibly nested) stats dict, keys joined with `_`."""
    flat: dict[str, float] = {}
    for key, value in stats.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten_numeric(value, f"{name}_"))
        elif isinstance(value, bool | int | float):
            flat[name] = float(value)
    return flat


def _metric_name(key: str) -> str:
    return PREFIX + re.sub(r"[^a-zA-Z0-9_]", "_", key)


class EngineStatsCollector(Collector):
    def __init__(self) -> None:
        self._stats: dict[str, float] = {}
        self._positions: dict[str, list[float]] = {}

    def update(self, stats: dict) -> None:
        self._stats = flatten_numeric(stats)
        self._positions = {k: list(stats[k]) for k in POSITION_COUNTERS if k in stats}

    def collect(self) -> Iterator[Metric]:
        for key, values in self._positions.items():
            name, help_text = POSITION_COUNTERS[key]
            family = CounterMetricFamily(PREFIX + name, help_text, labels=["position"])
            for position, value in enumerate(values):
                family.add_metric([str(position)], value)
            yield family
        for key, value in self._stats.items():
            if key in COUNTERS:
                name, help_text = COUNTERS[key]
                yield CounterMetricFamily(PREFIX + name, help_text, value=value)
            elif key in GAUGES:
                name, help_text = GAUGES[key]
                yield GaugeMetricFamily(PREFIX + name, help_text, value=value)
            else:
                yield GaugeMetricFamily(_metric_name(key), f"engine stats key {key!r}", value)


class EngineMetrics:
    """The registry of one engine app: the stats collector plus per-request histograms."""

    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=False)
        self.stats_collector = EngineStatsCollector()
        self.registry.register(self.stats_collector)
        self.ttft = Histogram(
            PREFIX + "request_ttft_seconds",
            "Arrival to first output token, per finished request",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            PREFIX + "request_e2e_seconds",
            "Arrival to last output token, per finished request",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.http_finished = Counter(
            PREFIX + "http_requests_finished",
            "Generate streams served over HTTP, by finish reason",
            ["finish_reason"],
            registry=self.registry,
        )

    def observe_finished(self, finish_reason: str, metrics: RequestMetrics | None) -> None:
        self.http_finished.labels(finish_reason=finish_reason).inc()
        if metrics is not None and metrics.num_output_tokens > 0:
            self.ttft.observe(metrics.ttft_s)
            self.e2e.observe(metrics.e2e_s)

    def render(self, stats: dict) -> bytes:
        self.stats_collector.update(stats)
        return generate_latest(self.registry)
