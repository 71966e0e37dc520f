"""A prefill chunk after a prefix: two flash calls merged by log-sum-exp, against one SDPA
call with a bottom-right causal mask on the gathered context (the reference).

Both read the same scattered paged blocks; they must agree for prefixes that end mid-block
and on a block boundary, grouped and plain heads, and chunks of one token.
"""

import pytest
import torch
import torch.nn.functional as F

from once.engine import attention
from once.engine.attention import AttentionMetadata, PagedKVCache, PrefillChunk, paged_attention


def _case(chunk_len, num_prior, block_size, num_heads, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(7 * chunk_len + num_prior)
    total = num_prior + chunk_len
    num_blocks = -(-total // block_size)
    cache = PagedKVCache(
        1, 2 * num_blocks + 3, block_size, num_kv_heads, head_dim, torch.float32, "cpu"
    )
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    table = torch.randperm(cache.num_blocks, generator=gen)[:num_blocks]
    pos = torch.arange(total)
    slots = table[pos // block_size] * block_size + pos % block_size
    q = torch.randn(chunk_len, num_heads, head_dim, generator=gen)
    k = torch.randn(chunk_len, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(chunk_len, num_kv_heads, head_dim, generator=gen)
    chunk = PrefillChunk(0, chunk_len, num_prior, table.to(torch.int32), block_size)
    meta = AttentionMetadata(slots[num_prior:], prefills=[chunk], use_kernel=False)
    return q, k, v, cache, meta, slots


def _reference(q, k, v, cache, slots, num_prior):
    # Written out here rather than taken from attention.py: the context by slot, a mask.
    k_flat, v_flat = cache.flat(0)
    k_ctx = torch.cat((k_flat[slots[:num_prior]], k)).transpose(0, 1)
    v_ctx = torch.cat((v_flat[slots[:num_prior]], v)).transpose(0, 1)
    q_pos = torch.arange(q.shape[0]) + num_prior
    mask = torch.arange(k_ctx.shape[1]).unsqueeze(0) <= q_pos.unsqueeze(1)
    reps = q.shape[1] // k.shape[1]
    k_ctx, v_ctx = k_ctx.repeat_interleave(reps, 0), v_ctx.repeat_interleave(reps, 0)
    o = F.scaled_dot_product_attention(q.transpose(0, 1), k_ctx, v_ctx, attn_mask=mask)
    return o.transpose(0, 1)


@pytest.mark.parametrize(
    "chunk_len, num_prior, block_size",
    [(512, 2048, 16), (100, 45, 16), (1, 300, 4), (70, 64, 16), (33, 1, 8), (200, 1000, 16)],
)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (4, 4, 128), (6, 2, 24)])
def test_the_merged_flash_calls_match_one_masked_call(
    chunk_len, num_prior, block_size, num_heads, num_kv_heads, head_dim
):
    q, k, v, cache, meta, slots = _case(
        chunk_len, num_prior, block_size, num_heads, num_kv_heads, head_dim
    )
    got = paged_attention(q, k, v, cache, 0, meta)
    want = _reference(q, k, v, cache, slots, num_prior)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    k_flat, v_flat = cache.flat(0)
    masked = attention.prefill_attention_masked(q, k, v, k_flat, v_flat, meta.prefills[0])
    torch.testing.assert_close(got, masked, atol=2e-5, rtol=1e-4)


def test_a_long_chunk_after_a_prefix_makes_no_mask_and_no_concatenation(monkeypatch):
    # The masked call is what the split replaces; it must not run where the op is present.
    calls = []
    monkeypatch.setattr(attention, "prefill_attention_masked", lambda *a: calls.append(a))
    q, k, v, cache, meta, _ = _case(512, 2048, 16, 9, 3, 64)
    paged_attention(q, k, v, cache, 0, meta)
    assert not calls and meta.prefills[0]._mask is None


def test_without_the_flash_op_the_masked_call_runs(monkeypatch):
    q, k, v, cache, meta, slots = _case(128, 300, 16, 9, 3, 64)
    monkeypatch.setattr(attention, "_FLASH_WITH_LSE", None)
    got = paged_attention(q, k, v, cache, 0, meta)
    assert meta.prefills[0]._mask is not None
    torch.testing.assert_close(got, _reference(q, k, v, cache, slots, 300), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("num_prior, block_size", [(45, 16), (64, 16), (3, 4), (1, 8)])
def test_the_prefix_is_gathered_block_by_block_in_position_order(num_prior, block_size):
    _, _, _, cache, meta, slots = _case(5, num_prior, block_size, 2, 2, 32)
    k_flat, _ = cache.flat(0)
    gathered = meta.prefills[0].gather_prefix(k_flat)
    assert torch.equal(gathered, k_flat[slots[:num_prior]])
