"""Tiny random-weight models for tests: written by transformers itself in milliseconds.

The same folder loads into the once engine (`loader.load_model_weights`) and into
transformers (`reference_model`), so logits can be compared one to one.
"""

from pathlib import Path

import torch

# Small enough to run a forward pass in a millisecond; big enough for GQA (4 heads share
# 2 KV heads), 2 layers (cache bugs between layers show) and a vocab that tests can sample.
TINY_VOCAB_SIZE = 256
TINY_CONFIG: dict[str, object] = {
    "vocab_size": TINY_VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

# transformers class prefix and what each family adds to the tiny config. Qwen2 needs
# nothing: its q/k/v carry a bias by definition. Qwen3's head_dim (32) differs from
# hidden/heads (16), as in real Qwen3.
ARCHITECTURES: dict[str, tuple[str, dict[str, object]]] = {
    "llama": ("Llama", {}),
    "mistral": ("Mistral", {"sliding_window": None}),
    "qwen2": ("Qwen2", {}),
    "qwen3": ("Qwen3", {"head_dim": 32}),
}


def make_tiny_model(
    folder: Path,
    architecture: str = "llama",
    seed: int = 0,
    init_std: float = 0.1,
    **overrides,
) -> Path:
    """Write a random-weight HF model folder; overrides go to the transformers config.

    The default init (std 0.02, norms of ones, zero biases) gives near-uniform logits and
    would hide an engine that ignores norm weights or biases, so every parameter is
    redrawn: matrices ~ N(0, init_std), norm weights ~ 1 + N(0, 0.1), biases ~ N(0, 0.1).
    """
    import transformers

    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"unknown architecture {architecture!r}; choose from {sorted(ARCHITECTURES)}"
        )
    prefix, family_overrides = ARCHITECTURES[architecture]
    config_cls = getattr(transformers, prefix + "Config")
    model_cls = getattr(transformers, prefix + "ForCausalLM")
    config = config_cls(**(TINY_CONFIG | family_overrides | overrides))
    torch.manual_seed(seed)
    model = model_cls(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                param.copy_(0.1 * noise)
            else:
                param.copy_(init_std * noise)
    folder = Path(folder)
    model.save_pretrained(folder)
    return folder


def reference_model(folder: Path, attn_implementation: str = "eager"):
    """The transformers model for a folder, fp32 and in eval mode, for parity tests."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation=attn_implementation
    )
    return model.eval()


class _ByteVocabulary:
    """What llguidance's TokenizerWrapper reads: id i is the byte i, ids 0-2 special."""

    def __init__(self, vocab_size: int, eos_token_id: int):
        self.eos_token_id = eos_token_id
        self.bos_token_id = TINY_CONFIG["bos_token_id"]
        self.tokens = [bytes([i % 256]) for i in range(vocab_size)]
        self.special_token_ids = [0, 1, 2]

    def __call__(self, text: bytes) -> list[int]:
        return [b for b in text if b > 2]


def byte_grammar_tokenizer(vocab_size: int = TINY_VOCAB_SIZE, eos_token_id: int = 2):
    """The grammar tokenizer of a tiny model (which has no tokenizer of its own): every id
    above 2 is one byte, so a constraint's text is its ids. Pass it to LLMEngine as
    `grammar_tokenizer` (a factory)."""
    from llguidance import LLTokenizer, TokenizerWrapper

    def build():
        return LLTokenizer(TokenizerWrapper(_ByteVocabulary(vocab_size, eos_token_id)))

    return build
