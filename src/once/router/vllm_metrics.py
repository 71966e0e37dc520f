"""What a vLLM server says about itself on `/metrics` (Prometheus text), as once reads it.

- load: `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`
  (a fraction in [0, 1] despite its name);
- its prefix cache: `vllm:prefix_cache_queries_total` and `vllm:prefix_cache_hits_total`
  (tokens looked up and tokens found), and `vllm:prompt_tokens_total`;
- work done: `vllm:generation_tokens_total`, `vllm:request_success_total` (every finish
  reason) and `vllm:num_preemptions_total`;
- its KV layout: `vllm:cache_config_info`'s labels `block_size` and `num_gpu_blocks`
  (the CPU build names its pool "gpu" blocks too).
Counters are summed over the label sets vLLM reports (one per engine); the parser is
prometheus_client's own.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class VllmMetrics:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which found
    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_finished: int = 0  # over every finish reason
    preemptions: int = 0
    block_size: int | None = None
    num_blocks: int | None = None

    @property
    def hit_ratio(self) -> float | None:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries
            if self.prefix_cache_queries
            else None
        )

    def since(self, earlier: VllmMetrics) -> VllmMetrics:
        """The counters' growth since `earlier`; gauges and layout as now."""
        return VllmMetrics(
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            kv_cache_usage=self.kv_cache_usage,
            prefix_cache_queries=self.prefix_cache_queries - earlier.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits - earlier.prefix_cache_hits,
            prompt_tokens=self.prompt_tokens - earlier.prompt_tokens,
            generation_tokens=self.generation_tokens - earlier.generation_tokens,
            requests_finished=self.requests_finished - earlier.requests_finished,
            preemptions=self.preemptions - earlier.preemptions,
            block_size=self.block_size,
            num_blocks=self.num_blocks,
        )


# sample name (prometheus_client strips no suffix from gauges; counters keep `_total`)
_SUMS = {
    "vllm:num_requests_running": "num_running",
    "vllm:num_requests_waiting": "num_waiting",
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
    "vllm:prefix_cache_queries_total": "prefix_cache_queries",
    "vllm:prefix_cache_hits_total": "prefix_cache_hits",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:generation_tokens_total": "generation_tokens",
    "vllm:request_success_total": "requests_finished",
    "vllm:num_preemptions_total": "preemptions",
}


def parse_vllm_metrics(text: str) -> VllmMetrics:
    sums: dict[str, float] = {}
    block_size: int | None = None
    num_blocks: int | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            field_name = _SUMS.get(sample.name)
            if field_name is not None:
                sums[field_name] = sums.get(field_name, 0.0) + sample.value
            elif sample.name == "vllm:cache_config_info":
                block_size = _int_label(sample.labels, "block_size")
                num_blocks = _int_label(sample.labels, "num_gpu_blocks")

    def count(name: str) -> int:
        return round(sums.get(name, 0.0))

    return VllmMetrics(
        num_running=count("num_running"),
        num_waiting=count("num_waiting"),
        kv_cache_usage=float(sums.get("kv_cache_usage", 0.0)),
        prefix_cache_queries=count("prefix_cache_queries"),
        prefix_cache_hits=count("prefix_cache_hits"),
        prompt_tokens=count("prompt_tokens"),
        generation_tokens=count("generation_tokens"),
        requests_finished=count("requests_finished"),
        preemptions=count("preemptions"),
        block_size=block_size,
        num_blocks=num_blocks,
    )


def _int_label(labels: dict[str, str], name: str) -> int | None:
    try:
        return int(labels[name])
    except (KeyError, ValueError):
        return None
