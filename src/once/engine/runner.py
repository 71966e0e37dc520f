"""Model runner: turns a scheduler output into one forward over a flat varlen batch.

Single-token items (decodes, and 1-token prefill tails) go first and run through the
paged decode kernel together; multi-token chunks follow, one SDPA each. Logits are
computed only for items that reach the end of their known tokens: those sample a token.
"""

import torch

from once.engine.attention import AttentionMetadata, PagedKVCache, PrefillChunk
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
        """Run one forward. Returns (logits (N, vocab), the N scheduled items sampled)."""
        decodes = [s for s in scheduled if s.num_new_tokens == 1]
        chunks = [s for s in scheduled if s.num_new_tokens > 1]
        ordered = decodes + chunks
        bs = self.block_size

        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        sampled: list[ScheduledRequest] = []
        prefills: list[PrefillChunk] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []

        for item in ordered:
            request = item.request
            start = request.num_computed_tokens
            end = start + item.num_new_tokens
            block_ids = self.kv.block_ids(request.request_id)
            row = len(input_ids)
            input_ids.extend(request.all_token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(block_ids[p // bs] * bs + p % bs for p in range(start, end))
            if item.num_new_tokens == 1:
                decode_tables.append(block_ids)
                decode_lens.append(end)
            else:
                context_slots = None
                if start:
                    context_slots = torch.tensor(
                        [block_ids[p // bs] * bs + p % bs for p in range(start)],
                        dtype=torch.long,
                        device=self.device,
                    )
                prefills.append(PrefillChunk(row, item.num_new_tokens, start, context_slots))
            if end == request.num_tokens:
                logits_rows.append(len(input_ids) - 1)
                sampled.append(item)

        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots, torch.long),
            num_decode_tokens=len(decodes),
            prefills=prefills,
            use_kernel=self.use_kernel,
        )
        if decodes:
            width = max(len(t) for t in decode_tables)
            padded = [t + [0] * (width - len(t)) for t in decode_tables]
            meta.decode_block_tables = self._tensor(padded, torch.int32)
            meta.decode_context_lens = self._tensor(decode_lens, torch.int32)

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
