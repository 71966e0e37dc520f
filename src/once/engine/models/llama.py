"""Llama-family forward over a paged KV cache.

One forward runs a flat "varlen" batch: the new tokens of every scheduled sequence are
concatenated into one (T, hidden) tensor, so every linear layer runs once per step however
the batch mixes decodes, prefill chunks and prefix hits. Only attention looks at sequence
boundaries (see `once.engine.attention`).

Weights use Hugging Face names on load; q/k/v and gate/up are fused at load time so each
layer does 4 matmuls instead of 7.
"""

import math

import torch
import torch.nn.functional as F

from once.engine.attention import AttentionMetadata, paged_attention
from once.engine.memory import copy_to_huge
from once.engine.models.config import ModelConfig
from once.engine.ops import (
    Fp32Weights,
    WeightFormat,
    add_rms_norm,
    linear,
    rope_leading_heads,
    rotate_half_pairs,
    silu_mul,
)
from once.protocol.errors import ModelLoadError


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = dict(config.rope_scaling or ())
    if scaling.get("rope_type", scaling.get("type")) == "llama3":
        # Llama 3.1 long-context scaling: keep high frequencies, divide low ones by
        # `factor`, and blend smoothly in between (same formula as the reference).
        factor = scaling["factor"]
        low_freq_factor = scaling.get("low_freq_factor", 1.0)
        high_freq_factor = scaling.get("high_freq_factor", 4.0)
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        low_freq_wavelen = old_len / low_freq_factor
        high_freq_wavelen = old_len / high_freq_factor
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = torch.where(is_medium, blended, scaled)
    elif scaling.get("rope_type", scaling.get("type")) == "yarn":
        inv_freq = _yarn_inv_freq(config, scaling)
    return inv_freq


def _yarn_inv_freq(config: ModelConfig, scaling: dict) -> torch.Tensor:
    """YaRN (Peng et al. 2023): dimensions that turn fewer than beta_slow times over the
    trained context are interpolated (frequency / factor), those that turn more than
    beta_fast times are kept, with a linear ramp between the two."""
    dim, base = config.head_dim, config.rope_theta
    factor = float(scaling["factor"])
    trained = scaling.get("original_max_position_embeddings", config.max_position_embeddings)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def dimension_turning(num_turns: float) -> float:
        # The rotary dimension whose wavelength fits num_turns times in the trained context.
        return dim * math.log(trained / (num_turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension_turning(beta_fast), dimension_turning(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    return extrapolated / factor * ramp + extrapolated * (1 - ramp)


def rope_attention_factor(config: ModelConfig) -> float:
    """YaRN scales cos and sin (so q.k by its square): 0.1 ln(factor) + 1 by default."""
    scaling = dict(config.rope_scaling or ())
    if scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(scale: float, weight: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0

    factor = float(scaling["factor"])
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
    return mscale(factor)


class RotaryEmbedding:
    """cos/sin tables for all positions, indexed per token (non-interleaved halves)."""

    def __init__(self, config: ModelConfig, max_len: int, device, dtype):
        inv_freq = rope_inv_freq(config)
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)
        scale = rope_attention_factor(config)
        self.cos = (freqs.cos() * scale).to(device=device, dtype=dtype)  # (max_len, dim / 2)
        self.sin = (freqs.sin() * scale).to(device=device, dtype=dtype)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Looked up once per forward and shared by every layer: (T, 1, head_dim / 2).
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


class LlamaLayer:
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        prefix: str,
        weight_format: WeightFormat,
    ):
        def take(name):
            # Own, contiguous memory: loaded tensors may be memory-mapped file views.
            return copy_to_huge(weights[prefix + name])

        self.config = config
        self.input_norm = take("input_layernorm.weight")
        self.post_norm = take("post_attention_layernorm.weight")
        qkv_weight = copy_to_huge(torch.cat(
            [take("self_attn.q_proj.weight"), take("self_attn.k_proj.weight"),
             take("self_attn.v_proj.weight")]
        ))  # fmt: skip
        qkv_bias = None
        if config.attention_bias:
            qkv_bias = torch.cat(
                [take("self_attn.q_proj.bias"), take("self_attn.k_proj.bias"),
                 take("self_attn.v_proj.bias")]
            ).contiguous()  # fmt: skip
        self.qkv = weight_format.prepare(qkv_weight, qkv_bias)
        self.o_proj = weight_format.prepare(take("self_attn.o_proj.weight"))
        self.q_norm = take("self_attn.q_norm.weight") if config.qk_norm else None
        self.k_norm = take("self_attn.k_norm.weight") if config.qk_norm else None
        gate_up_weight = copy_to_huge(
            torch.cat([take("mlp.gate_proj.weight"), take("mlp.up_proj.weight")])
        )
        self.gate_up = weight_format.prepare(gate_up_weight)
        self.down_proj = weight_format.prepare(take("mlp.down_proj.weight"))

    def forward(self, x, delta, rope_tables, kv_cache, layer_idx, meta: AttentionMetadata):
        """Returns (residual stream, this layer's last delta): the add is fused into the
        next RMSNorm, so a layer starts with x + delta from the one before."""
        cfg = self.config
        eps = cfg.rms_norm_eps
        use_kernel = meta.use_kernel
        num_tokens = x.shape[0]
        q_size = cfg.num_heads * cfg.head_dim
        kv_size = cfg.num_kv_heads * cfg.head_dim

        x, h = add_rms_norm(x, delta, self.input_norm, eps, use_kernel)
        qkv = linear(h, self.qkv, use_kernel)  # (T, q + 2 kv)
        cos, sin = rope_tables
        if self.q_norm is None:
            # q and k are adjacent in the fused projection: rotate both in one pass.
            num_qk_heads = cfg.num_heads + cfg.num_kv_heads
            qk = rope_leading_heads(qkv, cos, sin, num_qk_heads, cfg.head_dim, use_kernel)
            q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        else:
            q = qkv[:, :q_size].view(num_tokens, cfg.num_heads, cfg.head_dim)
            k = qkv[:, q_size : q_size + kv_size].view(num_tokens, cfg.num_kv_heads, -1)
            q = rotate_half_pairs(F.rms_norm(q, (cfg.head_dim,), self.q_norm, eps), cos, sin)
            k = rotate_half_pairs(F.rms_norm(k, (cfg.head_dim,), self.k_norm, eps), cos, sin)
        v = qkv[:, q_size + kv_size :].view(num_tokens, cfg.num_kv_heads, cfg.head_dim)

        attn = paged_attention(q, k, v, kv_cache, layer_idx, meta)  # (T, n_heads, head_dim)
        attn_out = linear(attn.reshape(num_tokens, q_size), self.o_proj, use_kernel)

        x, h = add_rms_norm(x, attn_out, self.post_norm, eps, use_kernel)
        gate_up = linear(h, self.gate_up, use_kernel)
        return x, linear(silu_mul(gate_up, use_kernel), self.down_proj, use_kernel)


def required_weight_names(config: ModelConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + f"self_attn.{n}_proj.weight" for n in "qkvo"]
        names += [p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
        if config.attention_bias:
            names += [p + f"self_attn.{n}_proj.bias" for n in "qkv"]
        if config.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


class LlamaModel:
    """Plain tensors, no nn.Module: inference only, and nothing to trace or register."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        max_len: int,
        weight_format: WeightFormat = Fp32Weights(),
    ):
        """weight_format: how each matmul keeps its weight (ops.py): fp32 by default, with
        a oneDNN-packed second copy; `ops.weight_format` names the others (Q8_0)."""
        missing = [n for n in required_weight_names(config) if n not in weights]
        if missing:
            raise ModelLoadError(f"weights are missing tensor {missing[0]!r}")
        self.config = config
        embed = copy_to_huge(weights["model.embed_tokens.weight"])
        self.device, self.dtype = embed.device, embed.dtype
        self.embed = embed
        self.final_norm = weights["model.norm.weight"].clone()
        # A tied lm head shares the fp32 embedding in fp32; in another format it gets its
        # own copy (the lookup stays fp32: it reads one row per token).
        self.lm_head = weight_format.prepare(
            embed if config.tie_word_embeddings else copy_to_huge(weights["lm_head.weight"])
        )
        self.layers = [
            LlamaLayer(config, weights, f"model.layers.{i}.", weight_format)
            for i in range(config.num_layers)
        ]
        self.rope = RotaryEmbedding(config, max_len, self.device, self.dtype)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        kv_cache,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor,  # (N,) rows of the flat batch that need logits
    ) -> torch.Tensor:
        x = F.embedding(input_ids, self.embed)  # (T, hidden)
        rope_tables = self.rope.tables(positions)
        delta = None
        for i, layer in enumerate(self.layers):
            x, delta = layer.forward(x, delta, rope_tables, kv_cache, i, meta)
        assert delta is not None  # a model has at least one layer
        x = x + delta
        # The lm head is the biggest matmul: run it only on rows that are sampled.
        x = x.index_select(0, logits_indices)
        x = F.rms_norm(x, (self.config.hidden_size,), self.final_norm, self.config.rms_norm_eps)
        return linear(x, self.lm_head, meta.use_kernel)  # (N, vocab)
