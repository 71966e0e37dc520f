"""The paged decode kernel against the pure-torch reference, row groups included.

A verification's 1 + k rows run as one group whose rows end at growing context lengths;
the kernel must give each row exactly what a separate single-row decode would.
"""

import pytest
import torch

from once.engine.attention import (
    DECODE_PART_BLOCKS,
    AttentionMetadata,
    DecodeGroup,
    PagedKVCache,
    decode_attention,
)
from once.engine.kernels import load_cpu_kernels

BLOCK = 16
N_HEADS, N_KV_HEADS, HEAD_DIM = 9, 3, 64


def _cache(num_blocks: int, seed: int) -> PagedKVCache:
    cache = PagedKVCache(1, num_blocks, BLOCK, N_KV_HEADS, HEAD_DIM, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(seed)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    return cache


def _group(num_rows: int, last_lens: list[int], num_blocks: int, seed: int) -> DecodeGroup:
    gen = torch.Generator().manual_seed(seed)
    width = max((n + BLOCK - 1) // BLOCK for n in last_lens)
    # Scattered, distinct blocks per sequence, as a real block table has.
    tables = torch.stack([torch.randperm(num_blocks, generator=gen)[:width] for _ in last_lens])
    return DecodeGroup(num_rows, tables.to(torch.int32), torch.tensor(last_lens, dtype=torch.int32))


def _rows_one_by_one(group: DecodeGroup) -> DecodeGroup:
    """The same queries as single-row decodes: one table per row, at its own length."""
    offsets = torch.arange(group.num_rows - 1, -1, -1).repeat(group.block_tables.shape[0])
    lens = group.context_lens.repeat_interleave(group.num_rows) - offsets
    tables = group.block_tables.repeat_interleave(group.num_rows, dim=0)
    return DecodeGroup(1, tables, lens.to(torch.int32))


needs_kernel = pytest.mark.skipif(load_cpu_kernels() is None, reason="no C compiler here")


@needs_kernel
@pytest.mark.parametrize("num_rows", [1, 2, 4, 8])
def test_row_groups_match_single_row_reference(num_rows):
    part = DECODE_PART_BLOCKS * BLOCK
    # Lengths where rows straddle a partition boundary, sit inside one block, or start
    # a new one; the shortest is no longer than the number of rows.
    last_lens = [num_rows, 37, part + 2, 2 * part + num_rows - 1, 300]
    cache = _cache(num_blocks=64, seed=num_rows)
    group = _group(num_rows, last_lens, 64, seed=num_rows + 100)
    q = torch.randn(group.num_tokens, N_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(7))
    kernel_meta = AttentionMetadata(torch.empty(0), group.num_tokens, [group], use_kernel=True)
    reference = AttentionMetadata(
        torch.empty(0), group.num_tokens, [_rows_one_by_one(group)], use_kernel=False
    )
    got = decode_attention(q, cache, 0, kernel_meta)
    want = decode_attention(q, cache, 0, reference)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@needs_kernel
def test_mixed_groups_keep_their_rows_in_order():
    cache = _cache(num_blocks=48, seed=1)
    singles = _group(1, [5, 90], 48, seed=2)
    verify = _group(4, [70, 200], 48, seed=3)
    q = torch.randn(singles.num_tokens + verify.num_tokens, N_HEADS, HEAD_DIM)
    total = q.shape[0]
    got = decode_attention(q, cache, 0, AttentionMetadata(torch.empty(0), total, [singles, verify]))
    want = torch.cat(
        [
            decode_attention(q[:2], cache, 0, AttentionMetadata(torch.empty(0), 2, [singles])),
            decode_attention(
                q[2:],
                cache,
                0,
                AttentionMetadata(torch.empty(0), 8, [_rows_one_by_one(verify)], use_kernel=False),
            ),
        ]
    )
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
