"""The limits one program run is held to, and what a replay pins down."""

from dataclasses import dataclass


@dataclass(frozen=True)
class RunLimits:
    timeout_s: float = 30.0  # wall time of the whole program, its tool calls included
    max_heap_bytes: int = 64 << 20
    max_tool_calls: int = 200
    # What the program sends out over its run (prints, tool arguments, its result): the
    # heap limit bounds one message, not their sum, which Python would otherwise keep.
    max_output_bytes: int = 16 << 20

    def __post_init__(self):
        if self.timeout_s <= 0 or self.max_heap_bytes <= 0 or self.max_output_bytes <= 0:
            raise ValueError("program limits must be positive")
        if self.max_tool_calls < 0:
            raise ValueError("max_tool_calls must be >= 0")


@dataclass(frozen=True)
class Determinism:
    """What makes a replay repeat itself: Date starts at `epoch_ms`, Math.random is seeded."""

    epoch_ms: int
    seed: int
