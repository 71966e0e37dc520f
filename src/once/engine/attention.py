"""Attention over the paged KV cache for a flat varlen batch.

Token order in a step's batch (built by the model runner):

    [ decode tokens: one per decoding sequence | prefill chunk of seq A | chunk of seq B ... ]
      <------------- num_decode_tokens ------->

Decodes go through the paged decode kernel (C, reads K/V through the block table in
place), one call per decode group: plain decodes are groups of one row per sequence; a
speculative verification's 1 + k rows form a group with 1 + k rows per sequence, which the
kernel serves with one pass over the context for all rows. Prefill chunks go to the C
prefill kernel (kernels/prefill_attention.c), which reads the prefix in place through the
block table and runs the attention as small GEMMs. Where it cannot run (no compiler,
another dtype or device, a head size it is not built for) a chunk that starts at position
0 runs causal SDPA on its own fresh K/V, and a chunk that continues a prefix runs in two
parts merged by their log-sum-exps (prefill_attention): the chunk against the prefix,
gathered block by block and seen whole by every query (no mask), and the chunk against
itself (causal).
"""

import ctypes
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from once.engine.kernels import load_cpu_kernels
from once.engine.memory import zeros_huge

# Context partition for the decode kernel's split-K: long contexts are cut into parts of
# this many blocks so two threads share even a single long sequence.
DECODE_PART_BLOCKS = 16
# Head sizes the prefill kernel is built for (prefill_attention.c); others run SDPA.
PREFILL_KERNEL_HEAD_DIMS = (32, 64, 128)
# The CPU flash attention behind SDPA, called directly because it also returns each
# query's log-sum-exp (out, lse); prefill_attention merges two calls with it.
_FLASH_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


class PagedKVCache:
    """K and V for every layer: (num_layers, num_blocks, block_size, num_kv_heads, head_dim)."""

    def __init__(self, num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device):
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k = zeros_huge(shape, dtype, device)
        self.v = zeros_huge(shape, dtype, device)
        self.block_size = block_size
        self.num_blocks = num_blocks

    @staticmethod
    def bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize

    def flat(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        # (num_blocks * block_size, num_kv_heads, head_dim): addressed by slot id.
        k, v = self.k[layer_idx], self.v[layer_idx]
        return k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])


@dataclass
class PrefillChunk:
    start: int  # row of the chunk's first token in the flat batch
    num_tokens: int
    num_prior_tokens: int  # context already in the cache before this chunk
    block_table: torch.Tensor  # (blocks up to the chunk's end,) int32
    block_size: int
    _mask: torch.Tensor | None = None

    def gather_prefix(self, flat: torch.Tensor) -> torch.Tensor:
        """The num_prior_tokens rows before the chunk out of one layer's flat cache
        (slots, n_kv_heads, head_dim), copied whole block by block: (num_prior, ...)."""
        num_blocks = -(-self.num_prior_tokens // self.block_size)
        blocks = flat.view(-1, self.block_size, *flat.shape[1:])
        gathered = blocks.index_select(0, self.block_table[:num_blocks])
        return gathered.view(-1, *flat.shape[1:])[: self.num_prior_tokens]

    def causal_mask(self, device) -> torch.Tensor:
        """Query i sits at absolute position num_prior + i and sees keys 0..num_prior + i
        (a bottom-right aligned causal mask; SDPA's is_causal is top-left aligned). Built
        once per chunk and shared by every layer; only the fallback without the flash op
        uses it."""
        if self._mask is None:
            q_pos = torch.arange(self.num_tokens, device=device) + self.num_prior_tokens
            k_pos = torch.arange(self.num_prior_tokens + self.num_tokens, device=device)
            self._mask = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)
        return self._mask


@dataclass
class DecodeGroup:
    """Sequences with num_rows consecutive query rows each; row r of a sequence sits at
    context length context_len - (num_rows - 1 - r) (its own token included)."""

    num_rows: int
    block_tables: torch.Tensor  # (num_seqs, max_blocks) int32
    context_lens: torch.Tensor  # (num_seqs,) int32: the length of each sequence's last row

    @property
    def num_tokens(self) -> int:
        return self.block_tables.shape[0] * self.num_rows


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (T,) where each new token's K/V is written
    num_decode_tokens: int = 0  # the first rows of the batch, group after group
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    use_kernel: bool = True


def paged_attention(q, k, v, kv_cache: PagedKVCache, layer_idx, meta: AttentionMetadata):
    # q: (T, n_heads, head_dim); k, v: (T, n_kv_heads, head_dim)
    k_flat, v_flat = kv_cache.flat(layer_idx)
    k_flat.index_copy_(0, meta.slot_mapping, k)
    v_flat.index_copy_(0, meta.slot_mapping, v)
    nd = meta.num_decode_tokens
    if nd == q.shape[0]:  # a decode-only step: no copy into a shared output
        return decode_attention(q, kv_cache, layer_idx, meta)
    lib = load_cpu_kernels() if meta.use_kernel and q.device.type == "cpu" else None
    kernel = lib if _prefill_kernel_takes(lib, q) else None
    if not nd and len(meta.prefills) == 1 and kernel is None:
        # One chunk is the whole batch (a long prompt's steps): SDPA's output as it is,
        # no copy into a shared output first (o_proj's reshape makes it contiguous).
        return prefill_attention(q, k, v, k_flat, v_flat, meta.prefills[0])
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous, as the kernel writes
    if nd:
        out[:nd] = decode_attention(q[:nd], kv_cache, layer_idx, meta)
    for chunk in meta.prefills:
        rows = slice(chunk.start, chunk.start + chunk.num_tokens)
        if kernel is None or not _prefill_kernel(kernel, q, out, rows, kv_cache, layer_idx, chunk):
            out[rows] = prefill_attention(q[rows], k[rows], v[rows], k_flat, v_flat, chunk)
    return out


def _prefill_kernel_takes(lib, q) -> bool:
    """Whether the C prefill kernel can serve these queries: built here, fp32, a head
    size it is built for, heads packed (q may be a view into the fused qkv rows, rows
    apart by a stride)."""
    head_dim = q.shape[2]
    if lib is None or q.dtype != torch.float32 or head_dim not in PREFILL_KERNEL_HEAD_DIMS:
        return False
    return q.stride(2) == 1 and q.stride(1) == head_dim


def _prefill_kernel(lib, q, out, rows: slice, kv_cache: PagedKVCache, layer_idx, chunk) -> bool:
    """Causal attention of one chunk by the C kernel, written into out[rows] (False if it
    could not allocate its scratch). It reads the context in place through the block
    table, so a chunk after a long prefix does not gather that prefix out of the cache
    first; measured against SDPA in `once bench engine` (bench/engine_bench/
    prefill_attention.py)."""
    k, v = kv_cache.k[layer_idx], kv_cache.v[layer_idx]
    chunk_q, chunk_out = q[rows], out[rows]
    head_dim = q.shape[2]
    rc = lib.paged_prefill_attention(
        chunk_q.data_ptr(), k.data_ptr(), v.data_ptr(), chunk.block_table.data_ptr(),
        chunk_out.data_ptr(), chunk.num_tokens, chunk.num_prior_tokens, q.shape[1], k.shape[2],
        head_dim, kv_cache.block_size, q.stride(0), ctypes.c_float(head_dim**-0.5),
        torch.get_num_threads(),
    )  # fmt: skip
    return rc == 0


def prefill_attention(q, k, v, k_flat, v_flat, chunk: PrefillChunk):
    """Causal attention of one chunk; q: (T, n_heads, head_dim), k, v: the chunk's own
    (T, n_kv_heads, head_dim). Returns (T, n_heads, head_dim), not contiguous.

    After a prefix it is two flash-attention calls merged by their log-sum-exps, where
    one call with a bottom-right causal mask (prefill_attention_masked) was the way before:

                 keys:  prefix (num_prior)      chunk (T)
        query 0      [ x x x x x x x x x ]  [ x . . . ]   part 1: no mask
        query 1      [ x x x x x x x x x ]  [ x x . . ]   part 2: is_causal=True
        query T-1    [ x x x x x x x x x ]  [ x x x x ]   (top-left aligned, as SDPA's)

        out = (out_1 e^lse_1 + out_2 e^lse_2) / (e^lse_1 + e^lse_2)

    Neither call reads a mask (SDPA turns a boolean one into a float tensor of T x context
    on every call, then adds it to every score) and part 2 skips the tiles above the
    diagonal; the prefix is gathered out of the paged cache block by block, with no
    concatenation with the chunk's K/V. The merge is exact: it matches the masked call to
    ~1e-7. Measured in `once bench engine` (bench/engine_bench/prefill_attention.py).
    """
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # (1, heads, T, D)
    gqa = q.shape[1] != k.shape[1]
    if chunk.num_prior_tokens == 0:
        o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=gqa)
        return o.squeeze(0).transpose(0, 1)
    if _FLASH_WITH_LSE is None or q.device.type != "cpu":
        return prefill_attention_masked(q, k, v, k_flat, v_flat, chunk)
    k_prefix, v_prefix = (chunk.gather_prefix(flat) for flat in (k_flat, v_flat))
    kph, vph = (t.transpose(0, 1).unsqueeze(0) for t in (k_prefix, v_prefix))
    out_1, lse_1 = _prefix_part(q, kph, vph)
    # The op takes grouped K/V heads as they are (n_heads a multiple of n_kv_heads).
    out_2, lse_2 = _FLASH_WITH_LSE(qh, kh, vh, 0.0, True)
    # out = (out_1 e^lse_1 + out_2 e^lse_2) / (e^lse_1 + e^lse_2), one pass over the rows:
    # out_2 + w (out_1 - out_2) with w = sigmoid(lse_1 - lse_2).
    weight = torch.sigmoid(lse_1 - lse_2).unsqueeze(-1)  # (1, n_heads, T, 1)
    return torch.lerp(out_2, out_1, weight).squeeze(0).transpose(0, 1)


def _prefix_part(q, k_prefix, v_prefix):
    """The chunk's queries against the prefix, no mask: out (1, n_heads, T, D) and lse.

    Every query sees the whole prefix, so the queries of the heads that share a K/V head
    can go as the rows of that one head: (1, n_kv_heads, group * T, D). The op then reads
    each K/V tile once for all of them rather than once per query head."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_prefix.shape[1]
    group = num_heads // num_kv_heads
    # (T, H, D) -> (H, T, D): head h = kv_head * group + g, rows of a K/V head adjacent.
    folded = q.transpose(0, 1).reshape(1, num_kv_heads, group * num_tokens, head_dim)
    out, lse = _FLASH_WITH_LSE(folded, k_prefix, v_prefix, 0.0, False)
    out = out.reshape(1, num_heads, num_tokens, head_dim)
    return out, lse.reshape(1, num_heads, num_tokens)


def prefill_attention_masked(q, k, v, k_flat, v_flat, chunk: PrefillChunk):
    """One SDPA call on the gathered context with a bottom-right causal mask: the way
    without the flash op (another device, a torch without it) and the reference."""
    k = torch.cat((chunk.gather_prefix(k_flat), k))
    v = torch.cat((chunk.gather_prefix(v_flat), v))
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    mask = chunk.causal_mask(q.device)
    gqa = q.shape[1] != k.shape[1]
    o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, enable_gqa=gqa)
    return o.squeeze(0).transpose(0, 1)


def decode_attention(q, kv_cache: PagedKVCache, layer_idx, meta: AttentionMetadata):
    lib = load_cpu_kernels() if meta.use_kernel and q.device.type == "cpu" else None
    use_kernel = lib is not None and q.dtype == torch.float32
    outs, row = [], 0
    for group in meta.decode_groups:
        rows = q[row : row + group.num_tokens]
        row += group.num_tokens
        out = _decode_kernel(lib, rows, kv_cache, layer_idx, group) if use_kernel else None
        outs.append(out if out is not None else _decode_torch(rows, kv_cache, layer_idx, group))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _decode_kernel(lib, q, kv_cache: PagedKVCache, layer_idx, group: DecodeGroup):
    q = q.contiguous()
    out = torch.empty_like(q)
    k, v = kv_cache.k[layer_idx], kv_cache.v[layer_idx]
    tables, lens = group.block_tables, group.context_lens
    _, n_heads, head_dim = q.shape
    rc = lib.paged_decode_attention(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), tables.data_ptr(), lens.data_ptr(),
        out.data_ptr(), tables.shape[0], group.num_rows, n_heads, k.shape[2], head_dim,
        kv_cache.block_size, tables.shape[1], DECODE_PART_BLOCKS,
        ctypes.c_float(head_dim**-0.5), torch.get_num_threads(),
    )  # fmt: skip
    return out if rc == 0 else None


def _decode_torch(q, kv_cache: PagedKVCache, layer_idx, group: DecodeGroup):
    # Reference path: one row per query, its context gathered into a padded batch, SDPA.
    k_flat, v_flat = kv_cache.flat(layer_idx)
    num_rows = group.num_rows
    tables = group.block_tables.long().repeat_interleave(num_rows, dim=0)
    row_offsets = torch.arange(num_rows - 1, -1, -1, device=q.device).repeat(
        group.block_tables.shape[0]
    )
    lens = group.context_lens.long().repeat_interleave(num_rows) - row_offsets
    _, n_heads, head_dim = q.shape
    max_len = int(lens.max())
    bs = kv_cache.block_size
    pos = torch.arange(max_len, device=q.device)
    slots = tables[:, pos // bs] * bs + pos % bs  # (num_rows_total, max_len)
    valid = pos.unsqueeze(0) < lens.unsqueeze(1)
    slots = torch.where(valid, slots, 0)
    k = k_flat[slots]  # (num_rows_total, max_len, n_kv_heads, head_dim)
    v = v_flat[slots]
    group_size = n_heads // k.shape[2]
    k = k.repeat_interleave(group_size, dim=2).transpose(1, 2)
    v = v.repeat_interleave(group_size, dim=2).transpose(1, 2)
    o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=valid[:, None, None, :])
    return o.squeeze(2)
