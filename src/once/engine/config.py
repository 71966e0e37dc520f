"""The engine's one frozen config, resolved once (flags > env > defaults)."""

import json
import math
import os
from dataclasses import dataclass, fields, replace
from typing import Any

from once.model_files import DEFAULT_MODEL

CPU_GEMMS = ("onednn", "torch")
# How the matmul weights are kept (engine/ops.py weight_format): as loaded, or llama.cpp's
# Q8_0 (engine/quant_q8_0.py).
WEIGHT_FORMATS = ("fp32", "q8_0")
KV_OFFLOAD_MODES = ("write_through", "write_back")
ROLES = ("both", "prefill", "decode")
KV_TRANSPORTS = ("shm", "tcp")
# once.kv_eviction's policies that need no view of the future.
ONLINE_EVICTION_POLICIES = ("lru", "leaf-lru", "lfu-da", "reuse")


@dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL  # a name in the model cache, an HF folder or a .gguf file
    device: str = "cpu"  # "cpu" or "cuda"
    dtype: str = "float32"
    block_size: int = 16  # tokens per KV block
    # The device KV pool (kv_cache_blocks below): num_kv_blocks when set, else kv_cache_gib;
    # both 0 (auto): 1 GiB, or one request of max_model_len when that is more.
    num_kv_blocks: int = 0
    kv_cache_gib: float = 0.0
    max_model_len: int = 0  # 0: the model's max_position_embeddings
    max_num_seqs: int = 64  # running requests per step
    max_num_batched_tokens: int = 512  # per-step token budget (chunked prefill)
    # Requests queued for a slot and KV blocks before new ones are refused with
    # engine_overloaded (503, retriable); 0: the queue is unbounded.
    max_num_waiting: int = 0
    enable_prefix_caching: bool = True
    num_threads: int = 0  # 0: the cores this process may use (once.cpus.usable_cores)
    seed: int = 0
    # Speculative decoding: "" (off), "ngram", "suffix" or "draft" (needs draft_model).
    speculative_method: str = ""
    num_speculative_tokens: int = 8  # most draft tokens verified per request per step
    draft_model: str = ""  # the draft model of method "draft" (same tokenizer as model)
    # Draft only as many ids per step as pay for their rows (speculative/governor.py), up to
    # num_speculative_tokens; off: always up to num_speculative_tokens.
    speculative_adaptive: bool = False
    # Publish KV events over ZMQ as vLLM does (e.g. "tcp://127.0.0.1:5557"); "" is off.
    kv_events_endpoint: str = ""
    # >= 1: after each step the loop sleeps (slowdown - 1) x the step's wall time, so the
    # engine runs at 1/slowdown of its speed (a throttled replica for routing benchmarks).
    slowdown: float = 1.0
    # CPU fp32 matmuls from 3 rows up: "onednn" (weights packed once for oneDNN's GEMM, a
    # second copy in memory; engine/ops.py) or "torch" (torch's own, MKL here).
    cpu_gemm: str = "onednn"
    # The matmul weights: "fp32" (as loaded) or "q8_0" (llama.cpp's 8-bit blocks, a quarter
    # of the bytes each decode step streams; engine/quant_q8_0.py). The embedding lookup,
    # norms, activations and KV cache stay in dtype.
    weights: str = "fp32"
    # The model's HF rope_scaling replaced, as JSON (vLLM: --hf-overrides), e.g. YaRN to
    # serve past the trained positions; "" keeps the model's own.
    rope_scaling: str = ""
    # KV tiers below the device pool (kv/tiered_connector.py), all off by default.
    # L2: host-memory slots; 0 is off. A lower tier stages its loads through host memory,
    # so with one on the host tier has at least as many slots as the device pool.
    kv_host_blocks: int = 0
    kv_disk_path: str = ""  # L3: a folder for block files; "" is off
    kv_disk_gib: float = 8.0  # L3's size bound
    kv_shared_url: str = ""  # L4: a Redis shared by replicas, e.g. redis://127.0.0.1:6379/0
    kv_shared_ttl_s: int = 3600
    # "write_through": blocks go down as they fill; "write_back": as they are evicted.
    kv_offload: str = "write_through"
    kv_load_timeout_s: float = 2.0  # a request waits this long for a prefetch at most
    kv_host_eviction: str = "lru"  # L2's policy, a name from once.kv_eviction
    kv_eviction: str = "lru"  # the device pool's policy, a name from once.kv_eviction
    # Session pause hints (kv/session_pauses.py), off by default: on the default replay
    # sample they did not pay (DESIGN.md). A pause expected to last up to kv_pause_keep_s
    # keeps the session's blocks in the device pool; a longer one offloads them.
    kv_pause_hints: bool = False
    kv_pause_keep_s: float = 10.0
    # Prefill/decode disaggregation (kv/disagg/transfer.py). "prefill": compute prompts (one output
    # token at most) and keep their blocks in a transfer store the decode side reads;
    # "decode": load a prompt's blocks from the prefill engine its request names; "both":
    # colocated, as without disaggregation.
    role: str = "both"
    kv_transfer: str = "shm"  # a prefill engine's store: "shm" (one host) or "tcp"
    kv_transfer_host: str = "127.0.0.1"  # tcp: where the store listens
    kv_transfer_port: int = 0  # tcp: 0 picks a free port (stats() reports the address)
    kv_transfer_blocks: int = 0  # the store's bound in blocks; 0: twice the device pool

    def __post_init__(self):
        if not (math.isfinite(self.slowdown) and self.slowdown >= 1.0):
            raise ValueError(f"slowdown must be a finite number >= 1.0, got {self.slowdown}")
        if self.cpu_gemm not in CPU_GEMMS:
            raise ValueError(f"cpu_gemm must be one of {CPU_GEMMS}, got {self.cpu_gemm!r}")
        if self.weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights must be one of {WEIGHT_FORMATS}, got {self.weights!r}")
        if self.kv_offload not in KV_OFFLOAD_MODES:
            raise ValueError(
                f"kv_offload must be one of {KV_OFFLOAD_MODES}, got {self.kv_offload!r}"
            )
        for name in ("kv_eviction", "kv_host_eviction"):
            if getattr(self, name) not in ONLINE_EVICTION_POLICIES:
                raise ValueError(
                    f"{name} must be one of {ONLINE_EVICTION_POLICIES}, got {getattr(self, name)!r}"
                )
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.kv_transfer not in KV_TRANSPORTS:
            raise ValueError(
                f"kv_transfer must be one of {KV_TRANSPORTS}, got {self.kv_transfer!r}"
            )
        if not 0 <= self.kv_transfer_port < 65536 or self.kv_transfer_blocks < 0:
            raise ValueError("kv_transfer_port must be in [0, 65535] and kv_transfer_blocks >= 0")
        if not (math.isfinite(self.kv_pause_keep_s) and self.kv_pause_keep_s >= 0):
            raise ValueError(f"kv_pause_keep_s must be >= 0, got {self.kv_pause_keep_s}")
        if not (math.isfinite(self.kv_cache_gib) and self.kv_cache_gib >= 0):
            raise ValueError(f"kv_cache_gib must be >= 0 (0: auto), got {self.kv_cache_gib}")
        if self.rope_scaling:
            try:
                if not isinstance(json.loads(self.rope_scaling), dict):
                    raise ValueError
            except ValueError:
                raise ValueError(
                    f"rope_scaling must be a JSON object, got {self.rope_scaling!r}"
                ) from None
        if self.num_kv_blocks < 0 or self.max_model_len < 0:
            raise ValueError("num_kv_blocks and max_model_len must be >= 0 (0: auto)")
        if self.kv_host_blocks < 0 or self.kv_disk_gib <= 0 or self.kv_load_timeout_s < 0:
            raise ValueError("kv_host_blocks, kv_disk_gib and kv_load_timeout_s must be >= 0")

    @property
    def has_kv_tiers(self) -> bool:
        return bool(
            self.kv_host_blocks or self.kv_disk_path or self.kv_shared_url or self.role != "both"
        )

    @classmethod
    def from_env(cls, **overrides) -> "EngineConfig":
        """Defaults < ONCE_ENGINE_* environment variables < explicit overrides."""
        values: dict[str, Any] = {}  # each of its field's type, read from f.type at run time
        for f in fields(cls):
            raw = os.environ.get(f"ONCE_ENGINE_{f.name.upper()}")
            if raw is None:
                continue
            try:
                if f.type in (bool, "bool"):
                    values[f.name] = raw.lower() in ("1", "true", "yes", "on")
                elif f.type in (int, "int"):
                    values[f.name] = int(raw)
                elif f.type in (float, "float"):
                    values[f.name] = float(raw)
                else:
                    values[f.name] = raw
            except ValueError:
                variable = f"ONCE_ENGINE_{f.name.upper()}"
                kind = getattr(f.type, "__name__", f.type)
                raise ValueError(f"{variable}={raw!r} is not a valid {kind}") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        return replace(cls(), **values)


class EngineSettingError(ValueError):
    """Settings that cannot work together on this model, found as the engine starts (the
    command line prints the message and exits, as for a bad flag)."""


DEFAULT_KV_CACHE_GIB = 1.0


def kv_cache_blocks(config: EngineConfig, bytes_per_block: int) -> int:
    """The device KV pool in blocks. Set (num_kv_blocks, else kv_cache_gib), it is what was
    set; auto, it is 1 GiB, or more when an asked max_model_len needs more: one request
    of the context asked for must fit (the engine refuses to start otherwise, as vLLM
    does), and the default once cut `--max-model-len 32768` to 23,296 without a word."""
    if config.num_kv_blocks:
        return config.num_kv_blocks
    num_blocks = int((config.kv_cache_gib or DEFAULT_KV_CACHE_GIB) * 2**30 // bytes_per_block)
    if not config.kv_cache_gib and config.max_model_len:
        num_blocks = max(num_blocks, -(-config.max_model_len // config.block_size))
    return num_blocks


def kv_cache_too_small(config: EngineConfig, num_blocks: int, bytes_per_block: int) -> str:
    need = -(-config.max_model_len // config.block_size)
    setting = (
        f"num_kv_blocks={config.num_kv_blocks}"
        if config.num_kv_blocks
        else f"--kv-cache-gib {config.kv_cache_gib:g}"
    )
    return (
        f"the KV cache ({setting}) holds {num_blocks * config.block_size} tokens, less "
        f"than one request of --max-model-len {config.max_model_len}: set --kv-cache-gib "
        f"to at least {need * bytes_per_block / 2**30:.2f}, leave it unset (the cache is "
        "then sized to the context), or lower --max-model-len"
    )
