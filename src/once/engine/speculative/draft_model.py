"""Draft-model drafter: a smaller model with the target's tokenizer drafts k ids per request.

KV state. The draft model is the project's own LlamaModel over a private PagedKVCache (a
pool of blocks beside the target's), so no attention code is duplicated and the same
kernels run. Each live request owns a DraftState: the ids whose draft K/V is in that cache
(position p lives in block_ids[p // block_size]) and its block list, from a free list.

Lazy sync. The engine tells a drafter nothing about rejections, so each propose compares
the ids a state holds with `request.all_token_ids` and rolls back to their common prefix,
keeping at most n - 1 ids of an n-id context (the last id always runs again: its logits
give the first draft). Accepted drafts pass that comparison, so after a verification only
the ids the draft has not seen run:

    state holds   c0 ... c(n-1) d1 d2 d3        (d4, the last draft, is never run)
    committed     c0 ... c(n-1) d1 d2 x         (d1 and d2 accepted, x the correction)
    kept          c0 ... c(n-1) d1 d2           -> run [x], then k - 1 one-id steps

Committed ids never change (all_token_ids only grows, preemption included), so the
comparison starts at the ids already known to be committed: it costs O(k), not O(n).

Batching. One forward runs every request's unseen ids (a few ids as that many decode
rows, a long run such as a first prompt as one prefill chunk), then up to k - 1 forwards
run one decode row per request still drafting. The pool has the target cache's token
slots plus room for every running request's drafts. When it runs dry (prefix sharing is
per request here, unlike the target's prefix cache) the states of requests outside the
batch are dropped, least recently used first, to be rebuilt from their committed ids
when next proposed; a request that still does not fit gets no draft this step.

Sampling. Greedy requests, and forced replays (their drafts are checked by equality),
draft the argmax with probs None. A request with temperature > 0 samples each draft id
from the draft model's distribution after the target's own temperature / top-k / top-p
processing (`verify.sampling_probs`), with the request's seeded generator when it has one
(the same one verification draws from), and returns those rows, padded with zeros to the
target's vocabulary, so rejection sampling stays lossless.
"""

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from once.engine.attention import AttentionMetadata, DecodeGroup, PagedKVCache, PrefillChunk
from once.engine.config import kv_cache_blocks
from once.engine.models.config import ModelConfig
from once.engine.models.llama import LlamaModel
from once.engine.request import Request
from once.engine.speculative.drafter import Draft
from once.engine.speculative.verify import sampling_probs
from once.engine.weight_formats import weight_format

# Most new ids of one request run as decode rows rather than as a prefill chunk.
MAX_DECODE_ROWS = 16


@dataclass
class DraftState:
    token_ids: list[int] = field(default_factory=list)  # ids whose K/V the draft cache holds
    block_ids: list[int] = field(default_factory=list)
    num_committed_ids: int = 0  # a prefix of token_ids known to be committed ids


def check_vocab(draft_vocab_size: int, target_vocab_size: int, draft_name="") -> None:
    if draft_vocab_size > target_vocab_size:
        where = f" ({draft_name})" if draft_name else ""
        raise ValueError(
            f"the draft model{where} has a vocabulary of {draft_vocab_size} ids but the "
            f"target has {target_vocab_size}: the draft model must use the target's "
            "tokenizer (a smaller draft vocabulary is fine when its ids are the target's)"
        )


def common_prefix_len(held: list[int], context: list[int], start: int) -> int:
    end = min(len(held), len(context))
    i = min(start, end)
    while i < end and held[i] == context[i]:
        i += 1
    return i


class DraftModelDrafter:
    def __init__(
        self,
        model: LlamaModel,
        target_vocab_size: int,
        num_blocks: int,
        block_size: int,
        max_len: int,
        seed: int = 0,
    ):
        """max_len: the draft model's last position + 1 (its rope table's length)."""
        check_vocab(model.config.vocab_size, target_vocab_size)
        cfg = model.config
        self.model = model
        self.target_vocab_size = target_vocab_size
        self.block_size = block_size
        self.max_len = max_len
        self.kv_cache = PagedKVCache(
            cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
            model.dtype, model.device,
        )  # fmt: skip
        self.free_blocks = list(range(num_blocks - 1, -1, -1))  # pop() gives low ids first
        self.states: OrderedDict[str, DraftState] = OrderedDict()  # least recently used first
        self.generator = torch.Generator().manual_seed(seed)  # for requests without a seed

    @classmethod
    def from_config(cls, config, target: ModelConfig) -> "DraftModelDrafter":
        """Load `config.draft_model` like the target: same loader, device and dtype."""
        from once.engine.loader import load_model_weights, model_config_from_hf, resolve_model_path
        from once.model_files import read_hf_config

        path = resolve_model_path(config.draft_model)
        # Refuse a foreign vocabulary before reading any weights.
        check_vocab(
            model_config_from_hf(read_hf_config(path), path).vocab_size, target.vocab_size, path
        )
        dtype = getattr(torch, config.dtype)
        draft, weights, _ = load_model_weights(path, dtype, config.device)
        max_len = min(
            config.max_model_len or target.max_position_embeddings,
            draft.max_position_embeddings,
            draft.sliding_window or draft.max_position_embeddings,
        )
        fmt = weight_format(config.weights, pack=config.cpu_gemm == "onednn")
        model = LlamaModel(draft, weights, max_len, fmt)
        return cls(
            model, target.vocab_size, draft_pool_blocks(config, target, dtype),
            config.block_size, max_len, config.seed,
        )  # fmt: skip

    # -- the Drafter protocol --------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, requests: list[Request], max_tokens: list[int]) -> list[Draft]:
        drafts = [Draft([]) for _ in requests]
        batch: list[tuple[int, Request, DraftState, int]] = []  # (index, request, state, k)
        in_batch = {r.request_id for r in requests}
        for index, (request, k) in enumerate(zip(requests, max_tokens, strict=True)):
            num_tokens = request.num_tokens
            # Drafts d1..dk sit at positions n..n+k-1; all but dk are run.
            k = min(k, self.max_len - num_tokens + 1)
            if k <= 0:
                if num_tokens >= self.max_len:  # past the draft model's context for good
                    self._drop(request.request_id)
                continue
            state = self.sync(request)
            if not self._reserve(state, num_tokens + k - 1, in_batch):
                self._drop(request.request_id)
                continue
            batch.append((index, request, state, k))
        if not batch:
            return drafts

        unseen = [(s, r.all_token_ids[len(s.token_ids) :]) for _, r, s, _ in batch]
        logits = self._forward(unseen)
        for _, request, state, _ in batch:
            state.num_committed_ids = request.num_tokens
        token_ids: list[list[int]] = [[] for _ in batch]
        probs: list[list[torch.Tensor]] = [[] for _ in batch]
        live = list(range(len(batch)))
        while True:
            for j, (token, row_probs) in zip(
                live, self._choose([batch[j][1] for j in live], logits), strict=True
            ):
                token_ids[j].append(token)
                if row_probs is not None:
                    probs[j].append(row_probs)
            live = [j for j in live if len(token_ids[j]) < batch[j][3]]
            if not live:
                break
            logits = self._forward([(batch[j][2], token_ids[j][-1:]) for j in live])

        for j, (index, _, _, _) in enumerate(batch):
            drafts[index] = Draft(token_ids[j], self._padded(probs[j]) if probs[j] else None)
        return drafts

    def on_finished(self, request: Request) -> None:
        self._drop(request.request_id)

    # -- per-request state -----------------------------------------------------------------

    def sync(self, request: Request) -> DraftState:
        """The request's state, rolled back to the ids it shares with the committed ones
        (at most all but the last), with the blocks past them freed."""
        state = self.states.get(request.request_id)
        if state is None:
            state = self.states[request.request_id] = DraftState()
        self.states.move_to_end(request.request_id)
        context = request.all_token_ids
        keep = common_prefix_len(state.token_ids, context, state.num_committed_ids)
        keep = min(keep, len(context) - 1)
        del state.token_ids[keep:]
        state.num_committed_ids = keep
        self._free(state, num_blocks=-(-keep // self.block_size))
        return state

    def _reserve(self, state: DraftState, num_tokens: int, keep: set[str]) -> bool:
        needed = -(-num_tokens // self.block_size) - len(state.block_ids)
        while len(self.free_blocks) < needed:
            victim = next((rid for rid in self.states if rid not in keep), None)
            if victim is None:
                return False
            self._drop(victim)
        state.block_ids.extend(self.free_blocks.pop() for _ in range(needed))
        return True

    def _free(self, state: DraftState, num_blocks: int) -> None:
        # Back in reverse, so the next pop() reuses this request's lowest freed block first.
        self.free_blocks.extend(reversed(state.block_ids[num_blocks:]))
        del state.block_ids[num_blocks:]

    def _drop(self, request_id: str) -> None:
        state = self.states.pop(request_id, None)
        if state is not None:
            self._free(state, num_blocks=0)

    # -- the draft model -------------------------------------------------------------------

    def _forward(self, items: list[tuple[DraftState, list[int]]]) -> torch.Tensor:
        """Run each state's new ids after the ids it holds; returns (len(items), vocab): the
        logits after each item's last new id, in item order."""

        # A short run of new ids (the usual catch-up after a verification: 1 or 2) is a
        # decode of that many rows, read by the kernel in one pass over the context;
        # a longer one (a first prompt) is a prefill chunk. paged_attention wants the
        # decode groups first, each group's sequences together, then the chunks.
        def kind(j):
            n = len(items[j][1])
            return (n > MAX_DECODE_ROWS, n)

        order = sorted(range(len(items)), key=kind)
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows = [0] * len(items)
        decode_groups: dict[int, tuple[list[list[int]], list[int]]] = {}  # rows -> tables, lens
        prefills: list[PrefillChunk] = []
        for j in order:
            state, new_ids = items[j]
            start, end = len(state.token_ids), len(state.token_ids) + len(new_ids)
            blocks = state.block_ids
            row = len(input_ids)
            input_ids.extend(new_ids)
            positions.extend(range(start, end))
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            if len(new_ids) <= MAX_DECODE_ROWS:
                tables, lens = decode_groups.setdefault(len(new_ids), ([], []))
                tables.append(blocks)
                lens.append(end)
            else:
                table = self._tensor(blocks[: (end + bs - 1) // bs], torch.int32)
                prefills.append(PrefillChunk(row, len(new_ids), start, table, bs))
            logits_rows[j] = len(input_ids) - 1
            state.token_ids.extend(new_ids)
        ids = self._tensor(input_ids, torch.long)
        if self.model.config.vocab_size < self.target_vocab_size:
            # An id the draft model lacks (a target's padding id) goes in as id 0: it can
            # only weaken the drafts that follow it.
            ids = ids.masked_fill(ids >= self.model.config.vocab_size, 0)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots, torch.long),
            num_decode_tokens=sum(rows * len(lens) for rows, (_, lens) in decode_groups.items()),
            prefills=prefills,
        )
        for num_rows, (tables, lens) in decode_groups.items():
            width = max(len(t) for t in tables)
            padded = [t + [0] * (width - len(t)) for t in tables]
            meta.decode_groups.append(
                DecodeGroup(
                    num_rows, self._tensor(padded, torch.int32), self._tensor(lens, torch.int32)
                )
            )
        return self.model.forward(
            ids,
            self._tensor(positions, torch.long),
            self.kv_cache,
            meta,
            self._tensor(logits_rows, torch.long),
        )

    def _choose(
        self, requests: list[Request], logits: torch.Tensor
    ) -> list[tuple[int, torch.Tensor | None]]:
        """(token, probs row or None) per request: argmax, or a sample of the processed
        draft distribution (a CPU row, as the CPU generators need)."""
        greedy = [r.sampling.greedy or r.forced_output_ids is not None for r in requests]
        picks: list[int] = logits.argmax(dim=-1).tolist() if any(greedy) else []
        chosen: list[tuple[int, torch.Tensor | None]] = []
        for row, request in enumerate(requests):
            if greedy[row]:
                chosen.append((picks[row], None))
                continue
            probs = sampling_probs(logits[row : row + 1], request.sampling)[0].cpu()
            generator = request.generator or self.generator
            chosen.append((int(torch.multinomial(probs, 1, generator=generator)), probs))
        return chosen

    def _padded(self, rows: list[torch.Tensor]) -> torch.Tensor:
        # (k, target vocab): a smaller draft vocabulary never proposes the ids it lacks.
        probs = torch.stack(rows)
        if probs.shape[1] == self.target_vocab_size:
            return probs
        padded = probs.new_zeros(probs.shape[0], self.target_vocab_size)
        padded[:, : probs.shape[1]] = probs
        return padded

    def _tensor(self, values, dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.model.device)


def draft_pool_blocks(config, target: ModelConfig, dtype: torch.dtype) -> int:
    """As many token slots as the target's KV cache, plus every running request's drafts,
    so the draft pool runs dry only where the target's prefix cache shares blocks."""
    bs = config.block_size
    num_target_blocks = kv_cache_blocks(
        config,
        PagedKVCache.bytes_per_block(
            target.num_layers, bs, target.num_kv_heads, target.head_dim, dtype
        ),
    )
    blocks_per_draft = -(-config.num_speculative_tokens // bs) + 1
    return num_target_blocks + config.max_num_seqs * blocks_per_draft
