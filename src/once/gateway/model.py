"""What the gateway knows about a served model: its tokenizer, renderer and limits."""

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from once.gateway.detok import contiguous_vocab_bound
from once.gateway.prompt.render import PromptRenderer
from once.gateway.prompt.tokens import PromptBuilder
from once.gateway.safety.checker import SafetyChecker
from once.model_files import load_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class ModelRuntime:
    name: str
    tokenizer: "PreTrainedTokenizerBase"  # a fast tokenizer: its Rust `backend_tokenizer`
    renderer: PromptRenderer
    builder: PromptBuilder
    max_model_len: int
    accepts_images: bool = False
    safety: SafetyChecker | None = None  # None: no input check
    # The longest token's text, in characters: no token covers more, so a prompt of N
    # characters has at least N / this many tokens (prepare.py rejects on that bound).
    max_token_chars: int = 64

    @classmethod
    def load(
        cls, name: str, folder: Path, max_model_len: int, safety: SafetyChecker | None = None
    ) -> "ModelRuntime":
        tokenizer = load_tokenizer(folder)
        contiguous_vocab_bound(tokenizer.backend_tokenizer)  # computed once, not by a request
        renderer = PromptRenderer(tokenizer)
        return cls(
            name=name,
            tokenizer=tokenizer,
            renderer=renderer,
            builder=PromptBuilder(renderer, tokenizer),
            max_model_len=max_model_len,
            safety=safety,
            max_token_chars=max(len(token) for token in tokenizer.get_vocab()),
        )
