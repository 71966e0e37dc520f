"""Prefill attention at long context: the engine's path against torch SDPA, one run.

One layer's attention for a `CHUNK_TOKENS`-token prefill chunk after 2k and 8k tokens of
context, with the served model's head shape. Four ways, each ending with its output as
o_proj takes it, (tokens, heads * head_dim):

- `once`: `paged_attention`, what the engine runs: the chunk's K/V stored into scattered
  paged blocks, the C prefill kernel reading the prefix in place through the block table;
- `sdpa`: the baseline, torch SDPA as a stack with a contiguous KV cache calls it: the
  chunk's K/V stored after the context in (1, kv_heads, context, head_dim) tensors, one
  `scaled_dot_product_attention` call with a bottom-right causal mask (built once, as a
  model builds it once for all its layers) and `enable_gqa`. It pays no paging: no
  gather, no block table;
- `masked`: the engine's way before, for reference: the prefix gathered out of the paged
  cache and concatenated with the chunk's K/V, one SDPA call with the same mask;
- `two_flash`: the engine's torch path where the kernel cannot run (no compiler, another
  dtype), for reference: the prefix gathered block by block, two flash calls merged by
  their log-sum-exps.

Measurement: all ways in one process on the same threads, each warmed up twice, then
`REPEATS` rounds that run every way once, each round in another order (so a drift in
machine load hits every way, and none is always first). tok/s is the chunk's tokens over a
way's median time; `prefill_vs_sdpa_{2k,8k}` is the median over rounds of sdpa's time
over once's time in the same round (bar: >= 1.0), which a slow stretch of the machine
moves far less than a ratio of two separately taken figures.
"""

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from once.engine import attention
from once.engine.attention import AttentionMetadata, PagedKVCache, PrefillChunk

CONTEXTS = {"2k": 2048, "8k": 8192}
CHUNK_TOKENS = 512
REPEATS = 21
WARM_UP = 2
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
    table = torch.randperm(2 * num_blocks, generator=gen)[:num_blocks]  # scattered blocks
    pos = torch.arange(total)
    slots = table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    q = torch.randn(CHUNK_TOKENS, num_heads, head_dim, generator=gen)
    k = torch.randn(CHUNK_TOKENS, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(CHUNK_TOKENS, num_kv_heads, head_dim, generator=gen)
    chunk = PrefillChunk(0, CHUNK_TOKENS, num_prior, table.to(torch.int32), BLOCK_SIZE)
    meta = AttentionMetadata(slots[num_prior:], prefills=[chunk])
    k_flat, v_flat = cache.flat(0)
    # The contiguous cache of the baseline holds the same context: (1, kv_heads, total, D).
    k_contig = k_flat[slots].transpose(0, 1).unsqueeze(0).contiguous()
    v_contig = v_flat[slots].transpose(0, 1).unsqueeze(0).contiguous()
    mask = chunk.causal_mask("cpu")  # (CHUNK_TOKENS, total), bottom-right aligned
    qh = q.transpose(0, 1).unsqueeze(0)

    def once() -> None:
        attention.paged_attention(q, k, v, cache, 0, meta).reshape(CHUNK_TOKENS, -1)

    def sdpa() -> None:
        k_contig[0, :, num_prior:].copy_(k.transpose(0, 1))
        v_contig[0, :, num_prior:].copy_(v.transpose(0, 1))
        o = F.scaled_dot_product_attention(qh, k_contig, v_contig, attn_mask=mask, enable_gqa=True)
        o.squeeze(0).transpose(0, 1).reshape(CHUNK_TOKENS, -1)

    def write_chunk() -> None:  # the paged ways store the chunk's K/V first, as the engine
        k_flat.index_copy_(0, meta.slot_mapping, k)
        v_flat.index_copy_(0, meta.slot_mapping, v)

    def masked() -> None:
        write_chunk()
        o = attention.prefill_attention_masked(q, k, v, k_flat, v_flat, chunk)
        o.reshape(CHUNK_TOKENS, -1)

    def two_flash() -> None:
        write_chunk()
        o = attention.prefill_attention(q, k, v, k_flat, v_flat, chunk)
        o.reshape(CHUNK_TOKENS, -1)

    return {"once": once, "sdpa": sdpa, "masked": masked, "two_flash": two_flash}


def _time(run: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    run()
    return time.perf_counter() - t0


def measure(num_heads: int, num_kv_heads: int, head_dim: int, log=print) -> dict:
    results: dict = {
        "chunk_tokens": CHUNK_TOKENS,
        "threads": torch.get_num_threads(),
        "repeats": REPEATS,
        "baseline": "torch SDPA on contiguous K/V, bottom-right causal mask, enable_gqa",
    }
    for label, num_prior in CONTEXTS.items():
        log(f"prefill attention at {label} context ...")
        ways = _case(num_prior, num_heads, num_kv_heads, head_dim)
        for run in ways.values():
            for _ in range(WARM_UP):  # first calls build masks, the kernel library, buffers
                run()
        names = list(ways)
        rounds: list[dict[str, float]] = []
        for repeat in range(REPEATS):
            shift = repeat % len(names)
            rounds.append({name: _time(ways[name]) for name in names[shift:] + names[:shift]})
        for name in names:
            median_s = statistics.median(r[name] for r in rounds)
            results[f"prefill_attention_tok_s_{label}_{name}"] = round(CHUNK_TOKENS / median_s, 1)
        ratio = statistics.median(r["sdpa"] / r["once"] for r in rounds)
        results[f"prefill_vs_sdpa_{label}"] = round(ratio, 3)
        spread = [r["sdpa"] / r["once"] for r in rounds]
        results[f"prefill_vs_sdpa_{label}_range"] = [round(min(spread), 3), round(max(spread), 3)]
    return results
