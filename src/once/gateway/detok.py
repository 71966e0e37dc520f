"""Streaming detokenization: token ids in, final text out, exactly as a full decode.

Built on `tokenizers.decoders.DecodeStream`, which keeps a small window of ids and, for
each new id, decodes `window + id` and compares it with the decoded window (the prefix):

    ids:      [ ...emitted... | group | new ids ]
                              ^ window = the last emitted group plus ids not yet emitted
    emit:     decode(window)[len(decode(group)):]   when it grew and ends with a whole char

A step returns None while the text ends in U+FFFD (a multi-byte UTF-8 character split
across tokens: the emoji "😀" is three ByteLevel tokens here) or did not grow (a skipped
special token). Those ids stay pending until a later id completes the character. Decoding
a window *in context* is what keeps leading-space handling exact: Metaspace/SentencePiece
decoders strip the first token's leading space, so "▁world" alone is "world" but " world"
after "▁Hello". `prefix_ids` seeds that context with the ids before the first pushed one
(the prompt); only its last `NUM_CONTEXT_IDS` ids are kept, since decoders look no further
back than one character or one leading space, and decoding a whole 30k-token prompt again
would cost milliseconds per request. A prefix that ends inside a character is cut back to
its last whole character: DecodeStream's prefill would otherwise hold the prefix pending
and then return its text along with the first output.

DecodeStream has no flush, so this class mirrors its window (`_group_ids`, `_pending_ids`)
to decode what is still pending at the end: an incomplete character (decoded as U+FFFD,
as `tokenizer.decode` does) or a genuine U+FFFD the model produced.

Special tokens: with `skip_special_tokens=True` (the default) ids the tokenizer marks
special (`<|im_start|>`, `<|im_end|>` = eos, `<|endoftext|>` for SmolLM2) produce no text;
with False they come out as their literal content ("<|im_end|>"). Added tokens that are
not special (Qwen's `<tool_call>`) always come out as text, as in `tokenizer.decode`.

Invalid ids (negative, or not in the vocabulary) raise `InvalidRequestError` before any
state changes; DecodeStream itself would silently drop unknown ids.
"""

import operator
from collections.abc import Sequence

import tokenizers
from tokenizers.decoders import DecodeStream

from once.protocol.errors import InvalidRequestError

NUM_CONTEXT_IDS = 16


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        skip_special_tokens: bool = True,
        prefix_ids: Sequence[int] = (),
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        prefix = self._validated(prefix_ids[-NUM_CONTEXT_IDS:], param="prefix_ids")
        while prefix and tokenizer.decode(prefix, skip_special_tokens).endswith("\ufffd"):
            prefix.pop()
        self._stream = DecodeStream(prefix, skip_special_tokens)
        # Mirror of DecodeStream's window: after prefilling, the whole prefix is the group
        # whose decoded text the next step is compared against.
        self._group_ids: list[int] = prefix
        self._pending_ids: list[int] = []
        self.num_tokens = 0

    def push(self, token_ids: Sequence[int]) -> str:
        """Feed new ids; return the text that is now final ("" while a char is incomplete)."""
        ids = self._validated(token_ids, param="token_ids")
        pieces: list[str] = []
        # One step per id (not one step for the whole list): a list step returns nothing
        # at all when the chunk *ends* mid-character, which would delay complete text.
        for token_id in ids:
            self._pending_ids.append(token_id)
            piece = self._stream.step(self.tokenizer, token_id)
            if piece is not None:
                pieces.append(piece)
                self._group_ids = self._pending_ids
                self._pending_ids = []
        self.num_tokens += len(ids)
        return "".join(pieces)

    def flush(self) -> str:
        """Return what is still held at the end of the output (decoded as a full decode would)."""
        if not self._pending_ids:
            return ""
        window = self._group_ids + self._pending_ids
        decoded_group = self.tokenizer.decode(self._group_ids, self.skip_special_tokens)
        decoded_window = self.tokenizer.decode(window, self.skip_special_tokens)
        if not decoded_window.startswith(decoded_group):
            # Not seen with ByteLevel or Metaspace decoders; fail loudly rather than guess.
            raise ValueError(
                f"decoded text of ids {window} does not extend that of {self._group_ids}"
            )
        # Flush ends the output: a second flush returns "", and ids pushed after it start a
        # new text without context (the window may end in an incomplete character).
        self._stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        self._group_ids = []
        self._pending_ids = []
        return decoded_window[len(decoded_group) :]

    @property
    def num_pending_tokens(self) -> int:
        """Ids pushed whose text has not been returned yet (an incomplete character)."""
        return len(self._pending_ids)

    def _validated(self, token_ids: Sequence[int], *, param: str) -> list[int]:
        try:
            ids = [operator.index(token_id) for token_id in token_ids]
        except TypeError as error:
            raise InvalidRequestError(f"token ids must be integers: {error}", param=param) from None
        for token_id in ids:
            # Range first: the Rust side takes a u32 and overflows on anything wider.
            if not 0 <= token_id < 2**32 or self.tokenizer.id_to_token(token_id) is None:
                raise InvalidRequestError(
                    f"token id {token_id} is not in the tokenizer's vocabulary "
                    f"({self.tokenizer.get_vocab_size(with_added_tokens=True)} tokens)",
                    param=param,
                )
        return ids
