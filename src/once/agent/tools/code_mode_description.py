"""What the model reads about Code Mode: the `code` tool's name, limits and description.

The description states the limits, then one compact line per tool function
(`tools.name({arg: type, opt?: type}) - summary`, js_runtime/signatures.py); it is fixed
when the tool is built so the prompt prefix stays stable. The runtime that enforces the
limits is js_runtime's, run by code_mode.py, which imports this module (never the other
way round).
"""

from collections.abc import Iterable
from dataclasses import dataclass

from once.agent.tools.base import ToolSpec
from once.js_runtime.limits import RunLimits
from once.js_runtime.signatures import tool_signature

CODE_TOOL_NAME = "code"


@dataclass(frozen=True)
class CodeModeLimits:
    timeout_s: float = 30.0  # wall time of the whole program, nested calls included
    max_heap_bytes: int = 64 << 20
    max_tool_calls: int = 200
    max_output_tokens: int = 2000

    def __post_init__(self):
        if self.timeout_s <= 0 or self.max_heap_bytes <= 0:
            raise ValueError("code mode limits must be positive")
        if self.max_tool_calls < 0 or self.max_output_tokens < 16:
            raise ValueError("max_tool_calls must be >= 0 and max_output_tokens >= 16")

    @property
    def run_limits(self) -> RunLimits:
        return RunLimits(self.timeout_s, self.max_heap_bytes, self.max_tool_calls)


_INTRO = (
    "Run a JavaScript program in a fresh V8 isolate: no file system, network, modules or "
    "require; {timeout:g} s and {heap:g} MiB limits. The code is the body of an async "
    "function: use await, and return a value or print(...)/console.log(...). Only what it "
    "prints and returns comes back (non-strings as JSON), capped to {tokens} tokens, so "
    "filter and summarize in the program. Every tool is an async function on `tools` that "
    "takes one arguments object and resolves to the tool's output string, or throws an "
    "Error whose message is the tool's error output. Run independent calls together with "
    "Promise.all. Tools:"
)


def code_mode_tool_description(
    specs: Iterable[ToolSpec], limits: CodeModeLimits | None = None
) -> str:
    """What the model reads: how programs run, then one signature line per tool."""
    limits = limits or CodeModeLimits()
    intro = _INTRO.format(
        timeout=limits.timeout_s,
        heap=limits.max_heap_bytes / 2**20,
        tokens=limits.max_output_tokens,
    )
    lines = [intro]
    for spec in specs:
        if spec.function_name != CODE_TOOL_NAME:
            lines.append(tool_signature(spec.function_name, spec.description, spec.parameters))
    return "\n".join(lines)
