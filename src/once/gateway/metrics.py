"""The gateway's Prometheus counters: the work it did vs the work that was new.

Tokenization is counted twice over, as the ledger needs it: `prompt_tokens` (what the
engine was sent) against `tokenized_tokens` (what this gateway actually tokenized); a
continuation tokenizes only its new items. Safety checks count their own time and the
part of it that was hidden behind prefill (the check ended before the first token).
"""

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from once.gateway.tokens import FULL, BuiltPrompt


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.registry = registry

        def counter(name, doc, labels=()):
            return Counter(f"once_gateway_{name}", doc, labels, registry=registry)

        self.requests = counter(
            "requests", "Responses requests by transport and outcome", ("transport", "outcome")
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
        self.websocket_connections = Gauge(
            "once_gateway_websocket_connections", "Open WebSocket connections", registry=registry
        )
        self.inflight = Gauge("once_gateway_inflight", "Responses in progress", registry=registry)

    def record_build(self, built: BuiltPrompt) -> None:
        self.renders.labels("full" if built.mode == FULL else "incremental").inc()
        self.prompt_tokens.inc(len(built.prompt_ids))
        self.tokenized_tokens.inc(built.num_tokenized)

    def record_usage(self, usage: dict) -> None:
        self.cached_tokens.inc(usage["input_tokens_details"]["cached_tokens"])
        self.output_tokens.inc(usage["output_tokens"])

    def record_safety(self, verdict, first_token_at: float | None, started: float) -> None:
        self.safety_seconds.observe(verdict.elapsed_s)
        # The check started with dispatch; what ran past the first token was not hidden.
        ended = started + verdict.elapsed_s
        first = first_token_at if first_token_at is not None else time.perf_counter()
        exposed = max(0.0, min(verdict.elapsed_s, ended - first))
        self.safety_exposed_seconds.inc(exposed)
        self.safety_hidden_seconds.inc(verdict.elapsed_s - exposed)

    def value(self, counter, *labels) -> float:
        metric = counter.labels(*labels) if labels else counter
        return metric._value.get()
