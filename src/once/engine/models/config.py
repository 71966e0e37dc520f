"""The model shape the engine needs, read from a Hugging Face config.json.

One class covers the Llama family: Llama, Mistral, Qwen2 (bias on q/k/v), Qwen3 (RMSNorm
on q and k per head), SmolLM (a Llama).
"""

import json
import logging
from dataclasses import dataclass, replace

from once.protocol.errors import UnsupportedModelError

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: tuple | None = None  # sorted items of the HF rope_scaling dict
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q, k, v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of q and k
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        archs = hf.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs or hf.get('model_type')!r}; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        family = SUPPORTED_ARCHITECTURES[arch]
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        rope_scaling = hf.get("rope_scaling")
        rope_theta = hf.get("rope_theta")
        # transformers 5 moved rope settings under rope_parameters.
        rope_params = hf.get("rope_parameters") or {}
        if rope_theta is None:
            rope_theta = rope_params.get("rope_theta", 10000.0)
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
        if family == "qwen2" and not hf.get("use_sliding_window", False):
            window = None
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=int(hf.get("head_dim") or hidden // num_heads),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            rope_theta=float(rope_theta),
            rope_scaling=_rope_scaling_items(rope_scaling),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", family == "qwen2")),
            qk_norm=family == "qwen3",
            sliding_window=int(window) if window else None,
            eos_token_ids=eos_ids,
            bos_token_id=hf.get("bos_token_id"),
        )

    def with_rope_scaling(self, rope_scaling: dict) -> "ModelConfig":
        """The model with another HF rope_scaling dict, as vLLM's `--hf-overrides` sets it:
        a context past the trained positions, e.g. {"rope_type": "yarn", "factor": 4.0,
        "original_max_position_embeddings": 8192}."""
        return replace(self, rope_scaling=_rope_scaling_items(rope_scaling))

    @property
    def trained_context(self) -> int:
        """Positions the model holds with its rope scaling: a scaled model's trained
        positions times its factor."""
        scaling = dict(self.rope_scaling or ())
        if not scaling:
            return self.max_position_embeddings
        original = scaling.get("original_max_position_embeddings", self.max_position_embeddings)
        return max(self.max_position_embeddings, int(original * float(scaling["factor"])))


ROPE_TYPES = ("default", "llama3", "yarn")


def _rope_scaling_items(rope_scaling: dict | None) -> tuple | None:
    if not rope_scaling:
        return None
    if not isinstance(rope_scaling, dict):
        raise UnsupportedModelError(f"rope_scaling must be an object, got {rope_scaling!r}")
    kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
    if kind not in (None, *ROPE_TYPES):
        raise UnsupportedModelError(
            f"unsupported rope_scaling {rope_scaling!r}; supported rope_type: {ROPE_TYPES}"
        )
    if kind in (None, "default"):
        return None
    factor = rope_scaling.get("factor")
    if not isinstance(factor, int | float) or factor < 1:
        raise UnsupportedModelError(f"rope_scaling needs a factor >= 1, got {rope_scaling!r}")
    return tuple(sorted(rope_scaling.items()))


def serving_model_config(model: ModelConfig, rope_scaling: str, max_model_len: int) -> ModelConfig:
    """The model as served: `rope_scaling` (JSON, "" for the model's own) replaces the
    config's, and a context asked past the positions the model holds is warned about
    (vLLM refuses it unless told to allow it; a model past its trained context rarely
    ends its replies)."""
    if rope_scaling:
        model = model.with_rope_scaling(json.loads(rope_scaling))
    if max_model_len > model.trained_context:
        logger.warning(
            "max_model_len %d is past the %d positions the model holds; set rope_scaling "
            '(e.g. {"rope_type": "yarn", "factor": %.1f, "original_max_position_embeddings": '
            "%d}) for a longer context",
            max_model_len,
            model.trained_context,
            max_model_len / model.max_position_embeddings,
            model.max_position_embeddings,
        )
    return model
