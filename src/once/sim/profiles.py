"""Replica profiles: the cost model of one simulated replica and its KV capacity.

The numbers and their sources live in `profiles.toml` next to this file. One engine step
(continuous batching, chunked prefill) costs

    step_s = step_base_s
           + decode_per_seq_s * num_decoding_seqs
           + decode_per_context_token_s * sum(context of each decoding seq)
           + prefill_per_token_s * num_prefill_tokens
           + prefill_attention_s_per_pair * num_attention_pairs

where a prefill chunk of n tokens after c computed tokens attends to n * (c + (n + 1) / 2)
keys (causal attention: token i of the chunk sees c + i + 1 keys).

The fields after `tpot_slo_s` are optional (0: not given) and only the KV tiers below the
device pool (`once.sim.tiers`) read them: the model's KV shape, from which a block's bytes
follow (or `kv_bytes_per_block` where the shape is not known), and each tier's bandwidth
and per-load latency; and for prefill/decode disaggregation (`once.sim.disagg.transfer`),
the bandwidth and latency of a KV transfer from a prefill replica to a decode replica.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields
from importlib import resources

DEFAULT_PROFILE = "h200-llama3.1-8b"
CPU_PROFILE = "cpu-once-smollm2"
MAX_KV_BLOCKS = 2000  # the cap per replica, in blocks of 512 tokens


_OPTIONAL_FIELDS = frozenset(
    {
        "num_layers",
        "num_kv_heads",
        "head_dim",
        "kv_dtype_bytes",
        "kv_bytes_per_block",
        "host_bandwidth_bytes_per_s",
        "host_load_latency_s",
        "disk_bandwidth_bytes_per_s",
        "disk_load_latency_s",
        "transfer_bandwidth_bytes_per_s",
        "transfer_latency_s",
    }
)


@dataclass(frozen=True)
class ReplicaProfile:
    name: str
    description: str
    step_base_s: float
    decode_per_seq_s: float
    decode_per_context_token_s: float
    prefill_per_token_s: float
    prefill_attention_s_per_pair: float
    max_num_batched_tokens: int
    max_num_seqs: int
    block_size: int
    kv_blocks: int
    ttft_slo_s: float
    tpot_slo_s: float
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    kv_dtype_bytes: int = 0
    kv_bytes_per_block: int = 0  # used when the shape above is not given
    host_bandwidth_bytes_per_s: float = 0.0
    host_load_latency_s: float = 0.0
    disk_bandwidth_bytes_per_s: float = 0.0
    disk_load_latency_s: float = 0.0
    transfer_bandwidth_bytes_per_s: float = 0.0  # prefill -> decode replica (`--pd`)
    transfer_latency_s: float = 0.0

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int | float):
                continue
            optional = field.name in _OPTIONAL_FIELDS
            if (optional and value < 0) or (not optional and not value > 0):
                bound = ">= 0" if optional else "> 0"
                raise ValueError(
                    f"profile {self.name!r}: {field.name} must be {bound}, got {value}"
                )
        if self.kv_blocks * self.block_size > MAX_KV_BLOCKS * 512:
            raise ValueError(
                f"profile {self.name!r}: {self.kv_blocks} blocks of {self.block_size} tokens "
                f"exceed the cap of {MAX_KV_BLOCKS} blocks of 512 tokens per replica"
            )

    @property
    def kv_block_bytes(self) -> int:
        """Bytes of one KV block: K and V of every layer for block_size tokens."""
        shape = (self.num_layers, self.num_kv_heads, self.head_dim, self.kv_dtype_bytes)
        if all(shape):
            layers, heads, head_dim, dtype_bytes = shape
            return 2 * layers * heads * head_dim * dtype_bytes * self.block_size
        if self.kv_bytes_per_block:
            return self.kv_bytes_per_block
        raise ValueError(
            f"profile {self.name!r} gives neither the model's KV shape nor kv_bytes_per_block"
        )

    def prefill_s(self, num_tokens: int, num_computed: int) -> float:
        """Compute time of a prefill chunk of `num_tokens` after `num_computed` tokens."""
        pairs = num_tokens * (num_computed + (num_tokens + 1) / 2)
        return self.prefill_per_token_s * num_tokens + self.prefill_attention_s_per_pair * pairs

    def decode_s(self, num_seqs: int, num_context_tokens: int) -> float:
        """Marginal cost of a decode step's sequences (without the step base)."""
        return (
            self.decode_per_seq_s * num_seqs + self.decode_per_context_token_s * num_context_tokens
        )

    @property
    def prefill_tokens_per_s(self) -> float:
        # Nominal speed the policies see: linear cost plus attention at a 4k-token context.
        return 1.0 / (self.prefill_per_token_s + self.prefill_attention_s_per_pair * 4096)

    @property
    def decode_tokens_per_s(self) -> float:
        # Nominal decode throughput the policies see: a step of 32 sequences at 4k context.
        step = self.step_base_s + self.decode_s(32, 32 * 4096)
        return 32 / step

    def with_overrides(self, **overrides: float | int) -> ReplicaProfile:
        known = {field.name for field in fields(self)}
        unknown = set(overrides) - known
        if unknown:
            raise ValueError(f"unknown profile fields: {sorted(unknown)}")
        values = {field.name: getattr(self, field.name) for field in fields(self)}
        values.update(overrides)
        return ReplicaProfile(**values)


def load_profiles(text: str | None = None) -> dict[str, ReplicaProfile]:
    if text is None:
        text = resources.files("once.sim").joinpath("profiles.toml").read_text()
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"bad profiles TOML: {exc}") from exc
    profiles = {}
    for name, entry in table.items():
        try:
            profiles[name] = ReplicaProfile(name=name, **entry)
        except TypeError as exc:
            raise ValueError(f"profile {name!r}: {exc}") from exc
    return profiles


def load_profile(name: str = DEFAULT_PROFILE) -> ReplicaProfile:
    profiles = load_profiles()
    if name not in profiles:
        raise ValueError(f"unknown replica profile {name!r}; choose one of {sorted(profiles)}")
    return profiles[name]
