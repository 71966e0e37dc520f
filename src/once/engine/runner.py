"""Model runner: turns a scheduler output into one forward over a flat varlen batch.

Single-token items (decodes, and 1-token prefill tails) go first and run through the
paged decode kernel together; multi-token chunks follow, one SDPA each. Logits are
computed only for items that reach the end of their known tokens: those sample a token.

A speculative verification carries 1 + k tokens: the last committed token and the k
drafted ids after it, run as 1 + k decode rows of growing length over one block table;
decodes are grouped by their number of rows, and the kernel reads each sequence's K/V once
for all of its rows. All its rows get logits (row i scores draft i + 1):

    positions   n-1   n    n+1  ...  n+k-1
    input ids   t     d1   d2   ...  dk
    logits      p0    p1   p2   ...  pk      (p0 judges d1, ..., pk gives the bonus token)
"""

import torch

from once.engine.attention import AttentionMetadata, DecodeGroup, PagedKVCache, PrefillChunk
from once.engine.kv.manager import KVCacheManager
from once.engine.scheduler import ScheduledRequest


class ModelRunner:
    def __init__(self, model, kv_cache: PagedKVCache, kv: KVCacheManager, use_kernel=True):
        self.model = model
        self.kv_cache = kv_cache
        self.kv = kv
        self.block_size = kv_cache.block_size
        self.device = model.device
        self.use_kernel = use_kernel

    def execute(self, scheduled: list[ScheduledRequest]):
        """Run one forward. Returns (logits (N, vocab), the scheduled items sampled): each
        sampled item owns 1 + len(its drafts) consecutive rows, in order."""
        # Verifications join the decodes: each of their rows is a decode of its own
        # length over the same block table (the kernel reads K/V in place, and every
        # row's K/V is written before attention runs), cheaper than gathering context.
        decodes = [s for s in scheduled if s.num_new_tokens == 1 or s.request.draft_token_ids]
        decodes.sort(key=lambda s: s.num_new_tokens)  # one decode group per row count
        chunks = [s for s in scheduled if s.num_new_tokens > 1 and not s.request.draft_token_ids]
        ordered = decodes + chunks
        bs = self.block_size

        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        sampled: list[ScheduledRequest] = []
        prefills: list[PrefillChunk] = []
        # Per row count: the block tables and last-row lengths of its sequences.
        decode_groups: dict[int, tuple[list[list[int]], list[int]]] = {}

        for item in ordered:
            request = item.request
            start = request.num_computed_tokens
            end = start + item.num_new_tokens
            block_ids = self.kv.block_ids(request.request_id)
            row = len(input_ids)
            drafts = request.draft_token_ids
            input_ids.extend(request.all_token_ids[start : end - len(drafts)])
            input_ids.extend(drafts)
            positions.extend(range(start, end))
            slots.extend(block_ids[p // bs] * bs + p % bs for p in range(start, end))
            if item.num_new_tokens == 1 or drafts:
                tables, lens = decode_groups.setdefault(item.num_new_tokens, ([], []))
                tables.append(block_ids)
                lens.append(end)
            else:
                # Blocks up to the chunk's end: its context is read through them.
                table = self._tensor(block_ids[: (end + bs - 1) // bs], torch.int32)
                prefills.append(PrefillChunk(row, item.num_new_tokens, start, table, bs))
            if item.samples:
                last = len(input_ids) - 1
                logits_rows.extend(range(last - len(drafts), last + 1))
                sampled.append(item)

        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots, torch.long),
            num_decode_tokens=sum(s.num_new_tokens for s in decodes),
            prefills=prefills,
            use_kernel=self.use_kernel,
        )
        for num_rows, (tables, lens) in decode_groups.items():
            width = max(len(t) for t in tables)
            padded = [t + [0] * (width - len(t)) for t in tables]
            meta.decode_groups.append(
                DecodeGroup(
                    num_rows,
                    self._tensor(padded, torch.int32),
                    self._tensor(lens, torch.int32),
                )
            )

        logits = self.model.forward(
            self._tensor(input_ids, torch.long),
            self._tensor(positions, torch.long),
            self.kv_cache,
            meta,
            self._tensor(logits_rows, torch.long),
        )
        return logits, sampled

    def _tensor(self, values, dtype):
        return torch.tensor(values, dtype=dtype, device=self.device)
