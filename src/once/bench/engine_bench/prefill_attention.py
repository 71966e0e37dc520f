"""Prefill attention at long context: the engine's path against torch SDPA, one run.

One layer's attention for a `CHUNK_TOKENS`-token prefill chunk after 2k and 8k tokens of
context, with the served model's head shape, K/V in scattered paged blocks as the engine
keeps them. Three ways, interleaved (so a drift in machine load hits all three):

- `once`: `paged_attention`, what the engine runs (the C kernel where `kernel_pays`,
  else SDPA on the gathered context);
- `sdpa`: torch SDPA on the gathered context with a bottom-right causal mask, the
  baseline (`prefill_attention`);
  (all three store the chunk's K/V in the cache first, as the engine does);
- `kernel`: the C kernel forced, for reference (issue 33: 1.3-3.4x slower than SDPA
  for these chunks, which is why the engine no longer sends them there).

Each figure is prefill tokens per second of that one layer (the chunk's tokens over the
best of `REPEATS` timings); `prefill_vs_sdpa_{2k,8k}` is once over sdpa (bar: >= 1.0).
"""

import time
from collections.abc import Callable

import torch

from once.engine import attention
from once.engine.attention import AttentionMetadata, PagedKVCache, PrefillChunk

CONTEXTS = {"2k": 2048, "8k": 8192}
CHUNK_TOKENS = 512
REPEATS = 6
BLOCK_SIZE = 16


def _case(num_prior: int, num_heads: int, num_kv_heads: int, head_dim: int):
    gen = torch.Generator().manual_seed(num_prior)
    total = num_prior + CHUNK_TOKENS
    num_blocks = -(-total // BLOCK_SIZE)
    cache = PagedKVCache(
        1, 2 * num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, torch.float32, "cpu"
    )
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    table = torch.randperm(2 * num_blocks, generator=gen)[:num_blocks]
    pos = torch.arange(total)
    slots = table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    q = torch.randn(CHUNK_TOKENS, num_heads, head_dim, generator=gen)
    k = torch.randn(CHUNK_TOKENS, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(CHUNK_TOKENS, num_kv_heads, head_dim, generator=gen)
    chunk = PrefillChunk(0, CHUNK_TOKENS, num_prior, table.to(torch.int32), BLOCK_SIZE)
    meta = AttentionMetadata(slots[num_prior:], prefills=[chunk])
    k_flat, v_flat = cache.flat(0)

    # Each way ends with its output as o_proj takes it: (tokens, heads * head_dim).
    def once() -> None:
        attention.paged_attention(q, k, v, cache, 0, meta).reshape(CHUNK_TOKENS, -1)

    def write_chunk() -> None:  # every way stores the chunk's K/V first, as the engine does
        k_flat.index_copy_(0, meta.slot_mapping, k)
        v_flat.index_copy_(0, meta.slot_mapping, v)

    def sdpa() -> None:
        write_chunk()
        attention.prefill_attention(q, k, v, k_flat, v_flat, chunk).reshape(CHUNK_TOKENS, -1)

    def kernel() -> None:
        write_chunk()
        out = torch.empty_like(q)
        lib = attention.load_cpu_kernels()
        pays = attention.kernel_pays
        attention.kernel_pays = lambda chunk: True  # type: ignore[assignment]
        try:
            if not attention._prefill_kernel(lib, q, out, slice(0, CHUNK_TOKENS), cache, 0, chunk):
                raise RuntimeError("the prefill kernel is not available here")
        finally:
            attention.kernel_pays = pays  # type: ignore[assignment]

    ways = {"once": once, "sdpa": sdpa}
    lib = attention.load_cpu_kernels()
    if lib is not None and head_dim in attention.PREFILL_KERNEL_HEAD_DIMS:
        ways["kernel"] = kernel  # no C compiler here, or a head size it does not take
    return ways


def _time(run: Callable[[], None], timings: list[float]) -> None:
    t0 = time.perf_counter()
    run()
    timings.append(time.perf_counter() - t0)


def measure(num_heads: int, num_kv_heads: int, head_dim: int, log=print) -> dict:
    results: dict = {"chunk_tokens": CHUNK_TOKENS, "threads": torch.get_num_threads()}
    for label, num_prior in CONTEXTS.items():
        log(f"prefill attention at {label} context ...")
        ways = _case(num_prior, num_heads, num_kv_heads, head_dim)
        timings: dict[str, list[float]] = {name: [] for name in ways}
        for run in ways.values():
            run()  # warm-up: first calls build masks, slots, the kernel library
        names = list(ways)
        for repeat in range(REPEATS):  # each round in another order: none always first
            shift = repeat % len(names)
            for name in names[shift:] + names[:shift]:
                _time(ways[name], timings[name])
        for name in ways:
            rate = CHUNK_TOKENS / min(timings[name])
            results[f"prefill_attention_tok_s_{label}_{name}"] = round(rate, 1)
        once, sdpa = (results[f"prefill_attention_tok_s_{label}_{n}"] for n in ("once", "sdpa"))
        results[f"prefill_vs_sdpa_{label}"] = round(once / sdpa, 3)
    return results
