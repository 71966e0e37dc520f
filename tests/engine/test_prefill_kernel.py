"""The C prefill attention kernel against SDPA, over scattered paged blocks.

A chunk after a prefix reads the prefix in place through its block table; the torch path
gathers it block by block and runs two flash calls merged by log-sum-exp (their parity
with one masked SDPA call is test_prefill_attention.py). Both must agree for chunks that
start at 0, continue a prefix, end mid-block, span more than one query tile, and are short
after a long prefix (the kernel then splits the keys into parts and merges them).
"""

import pytest
import torch

from once.engine.attention import AttentionMetadata, PagedKVCache, PrefillChunk, paged_attention
from once.engine.kernels import load_cpu_kernels

needs_kernel = pytest.mark.skipif(load_cpu_kernels() is None, reason="no C compiler here")


def _run(chunk_len, num_prior, block_size, num_heads, num_kv_heads, head_dim, use_kernel):
    gen = torch.Generator().manual_seed(chunk_len * 1000 + num_prior + head_dim)
    total = num_prior + chunk_len
    num_blocks = (total + block_size - 1) // block_size
    cache = PagedKVCache(1, 3 * num_blocks + 4, block_size, num_kv_heads, head_dim,
                         torch.float32, "cpu")  # fmt: skip
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    # Scattered blocks, as a real block table has.
    table = torch.randperm(cache.num_blocks, generator=gen)[:num_blocks]
    slots = torch.tensor([int(table[p // block_size]) * block_size + p % block_size
                          for p in range(total)])  # fmt: skip
    # q as the model hands it over: a view into a wider fused row (q | k | v).
    width = (num_heads + 2 * num_kv_heads) * head_dim
    fused = torch.randn(chunk_len, width, generator=gen)
    q = fused[:, : num_heads * head_dim].view(chunk_len, num_heads, head_dim)
    k = torch.randn(chunk_len, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(chunk_len, num_kv_heads, head_dim, generator=gen)
    chunk = PrefillChunk(0, chunk_len, num_prior, table.to(torch.int32), block_size)
    meta = AttentionMetadata(slots[num_prior:], prefills=[chunk], use_kernel=use_kernel)
    return paged_attention(q, k, v, cache, 0, meta)


@needs_kernel
@pytest.mark.parametrize(
    "chunk_len, num_prior, block_size",
    [(2, 0, 16), (37, 0, 16), (128, 0, 16), (70, 45, 16), (33, 300, 4), (100, 16, 8),
     (1, 200, 16), (300, 700, 16), (37, 4600, 16), (5, 1100, 16), (16, 3000, 4)],
)  # fmt: skip
@pytest.mark.parametrize(
    "num_heads, num_kv_heads, head_dim",
    [(9, 3, 64), (4, 4, 128), (6, 2, 32), (10, 2, 64), (14, 2, 64)],
)
def test_kernel_matches_sdpa(chunk_len, num_prior, block_size, num_heads, num_kv_heads, head_dim):
    args = (chunk_len, num_prior, block_size, num_heads, num_kv_heads, head_dim)
    got = _run(*args, use_kernel=True)
    want = _run(*args, use_kernel=False)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


@needs_kernel
def test_a_head_size_the_kernel_cannot_take_falls_back_to_sdpa(monkeypatch):
    from once.engine import attention

    calls = []
    real = attention.prefill_attention
    monkeypatch.setattr(attention, "prefill_attention", lambda *a: calls.append(1) or real(*a))
    got = _run(20, 8, 4, 2, 1, 24, use_kernel=True)  # head_dim 24: not a multiple of 16
    assert calls and got.shape == (20, 2, 24)
    calls.clear()
    _run(20, 8, 4, 2, 1, 32, use_kernel=True)
    assert not calls


@needs_kernel
@pytest.mark.parametrize("chunk_len, num_prior", [(512, 0), (512, 8192), (64, 2048), (16, 0)])
def test_the_kernel_takes_every_chunk(chunk_len, num_prior, monkeypatch):
    # Once the kernel ran its products as register-blocked GEMMs it beat SDPA at every
    # chunk size, from position 0 or after a prefix (results/bench_prefill_gemm_*.json);
    # before, it took only chunks of up to 64 tokens after a prefix.
    from once.engine import attention

    calls = []
    real = attention.prefill_attention
    monkeypatch.setattr(attention, "prefill_attention", lambda *a: calls.append(1) or real(*a))
    _run(chunk_len, num_prior, 16, 9, 3, 64, use_kernel=True)
    assert not calls


@needs_kernel
@pytest.mark.parametrize("threads", [1, 4])
def test_split_keys_merge_to_the_unsplit_result(threads):
    # With 4 threads a 37-token chunk after 4,600 tokens (2 query tiles x 3 kv heads: 6
    # tasks) has its keys split into parts, merged by their maxima and sums; with 1 thread
    # it is not split. Both must match SDPA.
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = _run(37, 4600, 16, 9, 3, 64, use_kernel=True)
        want = _run(37, 4600, 16, 9, 3, 64, use_kernel=False)
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
