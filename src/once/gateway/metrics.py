"""The gateway's Prometheus counters: the work it did vs the work that was new.

Tokenization is counted twice over, as the ledger needs it: `prompt_tokens` (what the
engine was sent) against `tokenized_tokens` (what this gateway actually tokenized); a
continuation tokenizes only its new items. Safety checks count their own time and the
part of it that was hidden behind prefill (the check ended before the first token). The
time the gateway adds to each response (pipeline.py) is a histogram of per-response sums
and a counter per stage.
"""

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from once.gateway.output import Usage
from once.gateway.prompt.tokens import FULL, BuiltPrompt

# Fine below the 5 ms bar, where the added time of a response lies: `once bench gateway`
# interpolates its percentiles within these buckets.
ADDED_SECONDS_BUCKETS = tuple(
    ms / 1000
    for ms in (0.25, 0.5, 0.75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 4.5, 5, 6, 7, 8, 10)
    + (12.5, 15, 20, 25, 30, 40, 50, 75, 100, 250, 500, 1000, 2500)
)
ADDED_STAGES = ("admit", "prepare", "events", "writes")


@dataclass
class AddedTime:
    """The wall time one response spent in the gateway's own sections (pipeline.py)."""

    admit_s: float = 0.0
    prepare_s: float = 0.0
    events_s: float = 0.0  # detokenize, parse, encode, frame, save
    writes_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.admit_s + self.prepare_s + self.events_s + self.writes_s


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

        def counter(name, doc, labels=()):
            return Counter(f"once_gateway_{name}", doc, labels, registry=registry)

        self.requests = counter(
            "requests", "Responses requests by transport and outcome", ("transport", "outcome")
        )
        self.api_requests = counter(
            "api_requests", "Requests prepared, by API and how they are answered", ("api", "mode")
        )
        self.renders = counter("renders", "Prompt builds by mode (full or incremental)", ("mode",))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens sent to the engine")
        self.tokenized_tokens = counter("tokenized_tokens", "Tokens this gateway tokenized")
        self.cached_tokens = counter("cached_tokens", "Prompt tokens the engine served from cache")
        self.output_tokens = counter("output_tokens", "Output tokens streamed")
        self.fallbacks = counter("incremental_fallbacks", "Continuations rendered in full")
        self.verifications = counter("verifications", "Incremental prompts checked in full")
        self.divergences = counter(
            "divergences", "Incremental prompts that differed from a full render"
        )
        self.content_filtered = counter("content_filtered", "Responses cut by the input check")
        self.failed = counter("failed", "Responses that failed in the engine")
        self.store_failures = counter(
            "store_failures", "Responses streamed whole that the response store failed to keep"
        )
        self.client_timeouts = counter(
            "client_timeouts",
            "Clients cut off: a body too slow to arrive or a write not taken in time",
            ("kind",),  # body | send
        )
        self.received_bytes = counter(
            "received_bytes", "Request payload bytes by transport", ("transport",)
        )
        self.safety_seconds = Histogram(
            "once_gateway_safety_check_seconds",
            "Input check time",
            registry=registry,
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
        )
        self.safety_hidden_seconds = counter(
            "safety_hidden_seconds", "Check time hidden behind prefill"
        )
        self.safety_exposed_seconds = counter(
            "safety_exposed_seconds", "Check time past the first token"
        )
        self.added_seconds = Histogram(
            "once_gateway_added_seconds",
            "Time the gateway adds to a response (its own sections, not the engine's)",
            registry=registry,
            buckets=ADDED_SECONDS_BUCKETS,
        )
        self.added_stage_seconds = counter(
            "added_stage_seconds", "Time the gateway adds, by stage", ("stage",)
        )
        for stage in ADDED_STAGES:
            self.added_stage_seconds.labels(stage)
        self.websocket_connections = Gauge(
            "once_gateway_websocket_connections", "Open WebSocket connections", registry=registry
        )
        self.inflight = Gauge("once_gateway_inflight", "Responses in progress", registry=registry)

    def record_build(self, built: BuiltPrompt) -> None:
        self.renders.labels("full" if built.mode == FULL else "incremental").inc()
        self.prompt_tokens.inc(len(built.prompt_ids))
        self.tokenized_tokens.inc(built.num_tokenized)

    def record_usage(self, usage: Usage) -> None:
        self.cached_tokens.inc(usage.cached_tokens)
        self.output_tokens.inc(usage.output_tokens)

    def record_safety(self, verdict, first_token_at: float | None, started: float) -> None:
        self.safety_seconds.observe(verdict.elapsed_s)
        # The check started with dispatch; what ran past the first token was not hidden.
        ended = started + verdict.elapsed_s
        first = first_token_at if first_token_at is not None else time.perf_counter()
        exposed = max(0.0, min(verdict.elapsed_s, ended - first))
        self.safety_exposed_seconds.inc(exposed)
        self.safety_hidden_seconds.inc(verdict.elapsed_s - exposed)

    def record_added_time(self, added: AddedTime) -> None:
        self.added_seconds.observe(added.total_s)
        for stage in ADDED_STAGES:
            self.added_stage_seconds.labels(stage).inc(getattr(added, f"{stage}_s"))

    def value(self, metric, *labels: str) -> float:
        """A counter's or gauge's current value, read through prometheus_client's public
        `collect()`; `labels` are the label values in the metric's label order."""
        for family in metric.collect():
            names = (family.name, f"{family.name}_total")
            for sample in family.samples:
                if sample.name in names and tuple(sample.labels.values()) == labels:
                    return sample.value
        return 0.0
