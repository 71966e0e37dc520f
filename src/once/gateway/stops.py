"""Stop strings on streamed text: cut at the first one, never show part of one.

Text arrives in pieces, and a stop string may straddle two of them, so the matcher holds
back the longest tail that is still a prefix of some stop string and releases it once
the next piece shows it is not. At a match the text before the stop goes out and the
rest of the output is dropped (the stop string itself is not shown, as in OpenAI's and
Anthropic's APIs); the caller ends generation there.
"""

from collections.abc import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(s for s in stops if s)
        self.matched: str | None = None
        self._pending = ""

    def push(self, text: str) -> str:
        """What may be shown of `text` now; after a match, nothing more."""
        if self.matched is not None or not self.stops:
            return "" if self.matched is not None else text
        buffer = self._pending + text
        cut, matched = len(buffer), None
        for stop in self.stops:
            index = buffer.find(stop)
            if index != -1 and index < cut:
                cut, matched = index, stop
        if matched is not None:
            self.matched, self._pending = matched, ""
            return buffer[:cut]
        keep = self._tail_that_may_start_a_stop(buffer)
        self._pending = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """The held-back tail, at the end of the output (it never became a stop)."""
        pending, self._pending = self._pending, ""
        return "" if self.matched is not None else pending

    def _tail_that_may_start_a_stop(self, buffer: str) -> int:
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if stop.startswith(buffer[len(buffer) - size :]):
                    longest = size
                    break
        return longest
