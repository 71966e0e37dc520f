"""A program's text output kept within a token budget: its head and its tail.

Code Mode and the gateway's programs both return only what a program printed and
returned, which can be any size; the model reads the first and last parts of it.
"""

from collections.abc import Callable

_TRUNCATION_MARKER = "\n... [{} tokens truncated] ...\n"


def estimate_tokens(text: str) -> int:
    return (len(text) + 3) // 4


def truncate_head_tail(
    text: str, max_tokens: int, count_tokens: Callable[[str], int] = estimate_tokens
) -> tuple[str, bool]:
    """Keep the head and the tail of `text` within `max_tokens`, with a marker between.

    Characters are kept in proportion to the token budget (less the marker's share), then
    shrunk by 10% until the counter agrees, so any tokenizer works.
    """
    num_tokens = count_tokens(text)
    if num_tokens <= max_tokens:
        return text, False
    budget = max_tokens - count_tokens(_TRUNCATION_MARKER.format(num_tokens))
    keep_chars = max(0, int(len(text) * budget / num_tokens))
    while True:
        head, tail = text[: keep_chars // 2], text[len(text) - keep_chars // 2 :]
        kept = count_tokens(head) + count_tokens(tail)
        truncated = head + _TRUNCATION_MARKER.format(num_tokens - kept) + tail
        if keep_chars == 0 or count_tokens(truncated) <= max_tokens:
            return truncated, True
        keep_chars = int(keep_chars * 0.9)
