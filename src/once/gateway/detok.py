"""Streaming detokenization: token ids in, final text out, exactly as a full decode.

The algorithm of `tokenizers.decoders.DecodeStream`, applied to a batch of ids at a time.
A window of ids is decoded and compared with the decoded group before it (the prefix):

    ids:      [ ...emitted... | group | new ids ]
                              ^ window = the last emitted group plus ids not yet emitted
    emit:     decode(window)[len(decode(group)):]   when it grew and ends with a whole char

A batch's ids go in one decode, so a burst costs two decodes, not two per id. When the
window's text ends in U+FFFD (a multi-byte UTF-8 character split across tokens: the emoji
"😀" is three ByteLevel tokens here) or did not grow (a skipped special token), the batch
is stepped id by id, as DecodeStream steps, so the complete characters before the split one
still go out; the ids of the incomplete one stay pending until a later id completes it.
Decoding a window *in context* is what keeps leading-space handling exact:
Metaspace/SentencePiece decoders strip the first token's leading space, so "▁world" alone
is "world" but " world" after "▁Hello". `prefix_ids` seeds that context with the ids before
the first pushed one (the prompt); only its last `NUM_CONTEXT_IDS` ids are kept, since
decoders look no further back than one character or one leading space, and decoding a
whole 30k-token prompt again would cost milliseconds per request. A prefix that ends inside
a character is cut back to its last whole character.

`flush` decodes what is still pending at the end: an incomplete character (decoded as
U+FFFD, as `tokenizer.decode` does) or a genuine U+FFFD the model produced.

Special tokens: with `skip_special_tokens=True` (the default) ids the tokenizer marks
special (`<|im_start|>`, `<|im_end|>` = eos, `<|endoftext|>` for SmolLM2) produce no text;
with False they come out as their literal content ("<|im_end|>"). Added tokens that are
not special (Qwen's `<tool_call>`) always come out as text, as in `tokenizer.decode`.

Invalid ids (negative, or not in the vocabulary) raise `InvalidRequestError` before any
state changes (a decode would silently drop unknown ids).
"""

import operator
import weakref
from collections.abc import Sequence

import tokenizers

from once.protocol.errors import InvalidRequestError

NUM_CONTEXT_IDS = 16

# Per tokenizer: n when every id in [0, n) is in its vocabulary (0 when it has holes), so
# validating a batch of ids is one min/max instead of a vocabulary lookup per id.
_contiguous_bounds: "weakref.WeakKeyDictionary[tokenizers.Tokenizer, int]" = (
    weakref.WeakKeyDictionary()
)


def contiguous_vocab_bound(tokenizer: tokenizers.Tokenizer) -> int:
    bound = _contiguous_bounds.get(tokenizer)
    if bound is None:
        ids = tokenizer.get_vocab(with_added_tokens=True).values()
        bound = len(ids) if max(ids, default=-1) == len(ids) - 1 else 0
        _contiguous_bounds[tokenizer] = bound
    return bound


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
        self._vocab_bound = contiguous_vocab_bound(tokenizer)
        prefix = self._validated(prefix_ids[-NUM_CONTEXT_IDS:], param="prefix_ids")
        while prefix and tokenizer.decode(prefix, skip_special_tokens).endswith("\ufffd"):
            prefix.pop()
        self._group_ids: list[int] = prefix  # the context the next text is cut from
        self._group_text = tokenizer.decode(prefix, skip_special_tokens)
        self._pending_ids: list[int] = []  # pushed ids whose text has not gone out yet
        self.num_tokens = 0

    def push(self, token_ids: Sequence[int]) -> str:
        """Feed new ids; return the text that is now final ("" while a char is incomplete)."""
        ids = self._validated(token_ids, param="token_ids")
        if not ids:
            return ""
        self.num_tokens += len(ids)
        piece = self._emit(self._pending_ids + ids)
        if piece is not None:
            return piece
        # The batch ends inside a character (or added no text): step id by id, so the
        # complete characters before the split one are not held back.
        pieces: list[str] = []
        for token_id in ids:
            piece = self._emit(self._pending_ids + [token_id])
            if piece is not None:
                pieces.append(piece)
            else:
                self._pending_ids.append(token_id)
        return "".join(pieces)

    def _emit(self, window_tail: list[int]) -> str | None:
        """Decode group + tail; on new whole text, make the tail the group and return it."""
        text = self.tokenizer.decode(self._group_ids + window_tail, self.skip_special_tokens)
        if len(text) <= len(self._group_text) or text.endswith("\ufffd"):
            return None
        if not text.startswith(self._group_text):
            # Not seen with ByteLevel or Metaspace decoders; fail loudly rather than guess.
            raise ValueError(
                f"decoded text of ids {self._group_ids + window_tail} does not extend that "
                f"of {self._group_ids}"
            )
        piece = text[len(self._group_text) :]
        self._group_ids = window_tail
        self._group_text = self.tokenizer.decode(window_tail, self.skip_special_tokens)
        self._pending_ids = []
        return piece

    def flush(self) -> str:
        """Return what is still held at the end of the output (decoded as a full decode would)."""
        if not self._pending_ids:
            return ""
        window = self._group_ids + self._pending_ids
        decoded_window = self.tokenizer.decode(window, self.skip_special_tokens)
        if not decoded_window.startswith(self._group_text):
            raise ValueError(
                f"decoded text of ids {window} does not extend that of {self._group_ids}"
            )
        tail = decoded_window[len(self._group_text) :]
        # Flush ends the output: a second flush returns "", and ids pushed after it start a
        # new text without context (the window may end in an incomplete character).
        self._group_ids, self._group_text, self._pending_ids = [], "", []
        return tail

    @property
    def num_pending_tokens(self) -> int:
        """Ids pushed whose text has not been returned yet (an incomplete character)."""
        return len(self._pending_ids)

    def _validated(self, token_ids: Sequence[int], *, param: str) -> list[int]:
        ids = list(token_ids)
        if all(type(token_id) is int for token_id in ids) and (
            not ids or (min(ids) >= 0 and max(ids) < self._vocab_bound)
        ):
            return ids  # the common case: plain ints inside a vocabulary without holes
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
