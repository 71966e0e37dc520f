"""The transformers baseline, pinned: fp32, SDPA attention, static batches, its own KV cache.

Decode step time, two methods (both reported):
  - streamer put times: one generate(64 tokens) call with a streamer that notes when
    each step's tokens arrive; the step is the mean gap after the first new token, with
    generate's own per-step overhead (logits processors, stopping criteria) included, as
    a user of `generate` pays it. Used for throughput configs.
  - manual loop: prefill with model(...) (chunked, so an 8k prompt fits in memory), then
    single-token forwards with past_key_values, each timed. Used at long contexts, where
    a second 8k prefill would double the cost of the measurement.
"""

import inspect
import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # transformers is imported where a model is loaded
    from transformers import Cache

# Prefill chunk for the manual loop: 8,000 tokens at once would materialize a
# (heads, 8000, 8000) fp32 attention score tensor per layer in SDPA's math path.
PREFILL_CHUNK = 2048


def _forward_with_cache(
    model, input_ids: torch.Tensor, cache: "Cache | None", **kwargs
) -> "tuple[torch.Tensor, Cache]":
    """One forward that extends `cache`; returns (logits, cache).

    transformers 5.2x renamed `past_key_values` to `cache` (the old name warns, then goes
    away in 5.40): use whichever this version's forward takes.
    """
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids, use_cache=True, **{name: cache}, **kwargs)
    new_cache = out.get("cache")
    if new_cache is None:
        new_cache = out.past_key_values
    return out.logits, new_cache


def load_model(folder, num_threads: int):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(num_threads)
    model = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.float32, attn_implementation="sdpa"
    )
    return model.eval()


def _generation_config(model, num_new: int):
    from transformers import GenerationConfig

    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = model.config.eos_token_id
    pad = model.config.pad_token_id
    if pad is None:
        pad = eos[0] if isinstance(eos, list) else eos
    # A fresh config, not the model's: its sampling defaults would only raise warnings.
    return GenerationConfig(
        max_new_tokens=num_new,
        min_new_tokens=num_new,  # suppresses eos: exactly num_new tokens per row
        do_sample=False,
        use_cache=True,
        eos_token_id=eos,
        pad_token_id=pad,
    )


class _StepClock:
    """A generate() streamer that only notes when each put arrives: the first put is the
    prompt, each later one a step's new tokens (one per row)."""

    def __init__(self) -> None:
        self.put_times: list[float] = []

    def put(self, value) -> None:
        self.put_times.append(time.perf_counter())

    def end(self) -> None:
        pass


def timed_generate(
    model, input_ids: torch.Tensor, num_new: int, clock: _StepClock | None = None
) -> tuple[float, torch.Tensor]:
    config = _generation_config(model, num_new)
    attention_mask = torch.ones_like(input_ids)  # all prompts one length: no padding
    with torch.inference_mode():
        started = time.perf_counter()
        out = model.generate(
            input_ids, attention_mask=attention_mask, generation_config=config, streamer=clock
        )
        elapsed = time.perf_counter() - started
    return elapsed, out


def warm_up(model) -> None:
    ids = torch.arange(100, 116).reshape(1, 16) % model.config.vocab_size
    timed_generate(model, ids, 4)


def measure_throughput(model, prompts: list[list[int]], num_output: int) -> dict:
    """Static batch of all prompts: output tokens/s, and the decode step as the mean gap
    between the steps' token puts after the first new token (a difference of two timed
    generate calls went negative on a busy machine)."""
    input_ids = torch.tensor(prompts, dtype=torch.long)  # (N, prompt_len)
    clock = _StepClock()
    started = time.perf_counter()
    full_s, out = timed_generate(model, input_ids, num_output, clock)
    num_new = out.shape[1] - input_ids.shape[1]
    if num_new != num_output:
        raise RuntimeError(f"transformers produced {num_new} tokens per row, not {num_output}")
    steps = clock.put_times[1:]  # put 0 is the prompt
    step_s = (steps[-1] - steps[0]) / (len(steps) - 1) if len(steps) > 1 else None
    return {
        "concurrency": len(prompts),
        "elapsed_s": full_s,
        "output_tok_s": len(prompts) * num_output / full_s,
        "first_token_s": steps[0] - started if steps else None,
        "decode_step_ms": None if step_s is None else 1000 * step_s,
        "step_method": "streamer put times",
    }


def measure_decode_loop(model, prompt: list[int], num_decode: int) -> dict:
    """Prefill one sequence, then time `num_decode` greedy single-token forwards."""
    input_ids = torch.tensor([prompt], dtype=torch.long)  # (1, T)
    step_s: list[float] = []
    with torch.inference_mode():
        started = time.perf_counter()
        cache = None
        for start in range(0, input_ids.shape[1], PREFILL_CHUNK):
            chunk = input_ids[:, start : start + PREFILL_CHUNK]
            logits, cache = _forward_with_cache(model, chunk, cache, logits_to_keep=1)
        prefill_s = time.perf_counter() - started
        token = logits[:, -1].argmax(-1, keepdim=True)  # (1, 1)
        for _ in range(num_decode):
            t0 = time.perf_counter()
            logits, cache = _forward_with_cache(model, token, cache)
            token = logits[:, -1].argmax(-1, keepdim=True)
            step_s.append(time.perf_counter() - t0)
    if cache is None or cache.get_seq_length() != len(prompt) + num_decode:
        raise RuntimeError("transformers' KV cache did not grow one token per step")
    return {
        "context_tokens": len(prompt),
        "decode_step_ms": 1000 * sum(step_s) / len(step_s),
        "num_decode_steps": len(step_s),
        "prefill_s": prefill_s,
        "prefill_tok_s": len(prompt) / prefill_s,
        "step_method": "manual loop",
    }
