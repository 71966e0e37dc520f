"""Prompt token ids for a response: a full render, or only the new items of a continuation.

A conversation's state after a response is the ids the engine saw (the prompt) plus the
ids the model actually sampled. A continuation appends to those ids the tokenization of
just the new text: what closes the assistant turn (`<|im_end|>\\n` minus the eos the model
already produced), the new items' messages, and the generation prompt. The cut always
touches a special token (right after the eos, or right before `<|im_end|>`/`<|im_start|>`),
where a separate tokenization cannot differ from tokenizing the whole text. The cut
before the output is not one: the generation prompt ends with a plain "\\n", so an output
that starts with whitespace is tokenized differently by a full render (which merges the
two); verification catches it like any other non-canonical output.

A full render and tokenization is done when there is no state, when the instructions,
tools or model changed (the `render_key`), or when a verification found a mismatch.
A stateless resend re-renders the text, so the two paths agree exactly when the sampled
ids are the canonical tokenization of the sampled text; `verify` checks that on a sample
of requests, counts divergences, and tells the caller to re-render that chain in full.
"""

import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from once.gateway.hosted.program_tool import is_program_internal
from once.gateway.prompt.render import NotIncrementalError, PromptRenderer, sorted_tools
from once.gateway.prompt.tool_items import CALL_TYPES, HOSTED_CALL_TYPES
from once.protocol.responses import REASONING, canonical_json

# Items the prompt shows nothing of (before the first that says what a turn is).
SKIPPED_ITEM_TYPES = (REASONING,)

FULL = "full"
INCREMENTAL = "incremental"


def render_key(model: str, instructions: str | None, tools: Sequence[dict]) -> str:
    """Fingerprint of everything besides the items that shapes the rendered prompt."""
    blob = canonical_json([model, instructions or "", sorted_tools(tools)])
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


@dataclass
class ConversationState:
    """Where a conversation stands after a response: enough to continue it cheaply."""

    render_key: str
    token_ids: list[int]  # prompt + sampled output ids (or the bare context after a warm-up)
    after_output: bool  # the ids end with model output inside an open assistant turn
    items: tuple[dict, ...] | None = None  # every item so far; None while not loaded
    needs_full_render: bool = False  # a verification failed on this chain
    # The role of the turn the ids end with, when known (None after a warm-up): a call
    # that comes next opens a new assistant turn unless that role is "assistant".
    last_role: str | None = None


@dataclass
class BuiltPrompt:
    prompt_ids: list[int]
    context_ids: list[int]  # prompt_ids without the trailing generation prompt
    mode: str  # FULL or INCREMENTAL
    num_tokenized: int  # ids produced by tokenization for this request
    num_chars_rendered: int
    render_key: str
    new_messages: list[dict] = field(default_factory=list)
    # Wall time of these synchronous steps (they never block): the capacity meter's stages.
    render_cpu_s: float = 0.0
    tokenize_cpu_s: float = 0.0


class PromptBuilder:
    def __init__(self, renderer: PromptRenderer, tokenizer):
        self.renderer = renderer
        self._encoder = tokenizer.backend_tokenizer  # the Rust tokenizer: no Python wrapping
        self.eos_ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        self.generation_prompt_ids = self.encode(renderer.generation_prompt_text)
        close = renderer.assistant_close_text
        eos = renderer.eos_text
        # After an output that ended with eos, the turn still needs what follows the eos.
        self.close_after_eos = close[len(eos) :] if eos and close.startswith(eos) else close
        self.close_without_eos = close
        # How every turn ends in the ids (`<|im_end|>\n`): the stateless states' boundaries.
        self.turn_end_ids = self.encode(close)

    def encode(self, text: str) -> list[int]:
        # The batch "fast" path skips character offsets, which the gateway never reads:
        # the same ids in ~60-80% of the time for a 1 KB prompt here.
        return self._encoder.encode_batch_fast([text], add_special_tokens=False)[0].ids

    def full(
        self,
        key: str,
        instructions: str | None,
        tools: Sequence[dict],
        items: Sequence[dict],
    ) -> BuiltPrompt:
        t0 = time.perf_counter()
        messages = self.renderer.messages(instructions, tools, items)
        text = self.renderer.render(messages, True, tools)
        t1 = time.perf_counter()
        ids = self.encode(text)
        t2 = time.perf_counter()
        context = self._strip_generation_prompt(ids)
        return BuiltPrompt(ids, context, FULL, len(ids), len(text), key, messages, t1 - t0, t2 - t1)

    def continuation(
        self, state: ConversationState, tools: Sequence[dict], new_items: Sequence[dict]
    ) -> BuiltPrompt:
        """Raises NotIncrementalError when only a full render can be right."""
        if state.needs_full_render:
            raise NotIncrementalError("a verification failed on this conversation")
        t0 = time.perf_counter()
        messages = self.renderer.item_messages(new_items)
        if messages and messages[0]["role"] == "assistant" and state.after_output:
            # It would merge into the open assistant turn in a full render.
            raise NotIncrementalError("new items continue the previous assistant turn")
        if _opens_with_call(new_items) and state.last_role in (None, "assistant"):
            # After a warm-up the ids do not say whether the context ends with an assistant
            # turn, which a leading function_call would join in a full render.
            raise NotIncrementalError("new items may continue the previous assistant turn")
        text = self.renderer.continuation_text(messages, tools)
        if state.after_output:
            ended_with_eos = bool(state.token_ids) and state.token_ids[-1] in self.eos_ids
            text = (self.close_after_eos if ended_with_eos else self.close_without_eos) + text
        t1 = time.perf_counter()
        new_ids = self.encode(text)
        t2 = time.perf_counter()
        prompt = state.token_ids + new_ids
        context = self._strip_generation_prompt(prompt)
        return BuiltPrompt(
            prompt,
            context,
            INCREMENTAL,
            len(new_ids),
            len(text),
            state.render_key,
            messages,
            t1 - t0,
            t2 - t1,
        )

    def _strip_generation_prompt(self, ids: list[int]) -> list[int]:
        n = len(self.generation_prompt_ids)
        if n and ids[-n:] == self.generation_prompt_ids:
            return ids[:-n]
        return list(ids)


def _opens_with_call(items: Sequence[dict]) -> bool:
    for item in items:
        if is_program_internal(item):
            continue  # shows nothing (a program's own call or output)
        if item["type"] in CALL_TYPES or item["type"] in HOSTED_CALL_TYPES:
            return item["type"] != "mcp_call" or not item.get("approval_request_id")
        if item["type"] not in SKIPPED_ITEM_TYPES:
            return False
    return False


@dataclass
class TokenizationStats:
    """What the gateway counts: work done vs work that was new."""

    full_renders: int = 0
    incremental_renders: int = 0
    tokens_tokenized: int = 0  # ids produced by tokenization
    prompt_tokens: int = 0  # ids sent to the engine
    verifications: int = 0
    divergences: int = 0
    fallbacks: int = 0  # continuations that had to render in full

    def record(self, built: BuiltPrompt) -> None:
        if built.mode == FULL:
            self.full_renders += 1
        else:
            self.incremental_renders += 1
        self.tokens_tokenized += built.num_tokenized
        self.prompt_tokens += len(built.prompt_ids)
