"""The harness's running estimate of how long each of its tools runs, sent as a hint.

After every tool call the loop records its wall time; the estimate per tool is an
exponentially weighted mean (ALPHA: recent runs count most, since a task's later steps
resemble each other more than its first), and `*` is the same over every tool, for a
tool not seen yet; a text action (a reply the harness runs as a command) counts as the
tool `(reply)`. The table goes on each request as `metadata.once_tool_pause_s`
(protocol/pause_hints.py): once's engine keeps or offloads the session's KV for the pause
that follows; other servers store the metadata and ignore it.
"""

import json
from collections import OrderedDict

from once.protocol.pause_hints import ANY_TOOL, METADATA_KEY, TEXT_REPLY

ALPHA = 0.3
MAX_VALUE_CHARS = 512  # OpenAI's bound on a metadata value


class ToolPauseEstimates:
    def __init__(self) -> None:
        self.seconds: OrderedDict[str, float] = OrderedDict()  # least recently run first

    def observe(self, tool: str | None, seconds: float) -> None:
        """One run of `tool` (None: the reply named no tool, a text action)."""
        for name in (tool or TEXT_REPLY, ANY_TOOL):
            old = self.seconds.get(name)
            self.seconds[name] = seconds if old is None else old + ALPHA * (seconds - old)
            self.seconds.move_to_end(name)

    def metadata(self) -> dict[str, str]:
        """{METADATA_KEY: the table as JSON}, the tools run least recently left out when
        it would pass the value bound; {} before any tool ran."""
        table = {name: round(seconds, 2) for name, seconds in self.seconds.items()}
        while table:
            value = json.dumps(table, separators=(",", ":"))
            if len(value) <= MAX_VALUE_CHARS:
                return {METADATA_KEY: value}
            oldest = next(name for name in table if name != ANY_TOOL)
            del table[oldest]
        return {}
