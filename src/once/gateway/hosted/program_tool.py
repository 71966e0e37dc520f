"""Programmatic tool calling as the model and the client see it, without running anything.

A request's `{"type": "programmatic_tool_calling"}` tool reaches the prompt as a
free-form (`custom`) tool named `program`, whose description lists the functions a
program may call: the request's function tools whose `allowed_callers` include
"programmatic", namespace functions as `tools.<namespace>__<name>` (as the harness's Code
Mode spells them: one flat name per function). A tool whose `allowed_callers` leave out "direct"
(absent means `["direct"]`, as in the API) stays out of the prompt's own tool list: the
model reaches it through a program only.

The model's call becomes a `program` item (`call_id`, `code`, `fingerprint`); the calls
its program makes to the client's functions become `function_call` items with
`caller: {"type": "program", "caller_id": <the program's call_id>}` and the call id
`<caller_id>#<n>`, n counting the program's client calls from 0. So a
`function_call_output` is known to answer a program's call from its id alone, with no look
back at the conversation (a client need not echo `caller`), and a replay finds each
call's output by id.

The fingerprint is `ptc1.<epoch ms>.<seed>.<digest>`: every run of the program sees Date
frozen at the epoch and Math.random seeded with the seed, and the digest (SHA-256 over
the version, epoch, seed and code, 32 hex) says whether the code or the fingerprint
changed since the program first ran. What a replayed program calls is checked against
the `function_call` items themselves (programs.py), which the client sends back (or the
store keeps) anyway.
"""

import hashlib
import re
import secrets
import time
from collections.abc import Sequence

from once.js_runtime.limits import Determinism, RunLimits
from once.js_runtime.signatures import tool_signature
from once.protocol.responses import FUNCTION_CALL, FUNCTION_CALL_OUTPUT

PROGRAM_TOOL_TYPE = "programmatic_tool_calling"
PROGRAM_TOOL_NAME = "program"
PROGRAM = "program"
PROGRAM_OUTPUT = "program_output"
NAMESPACE_JOIN = "__"
# What the description promises and the runner enforces (programs.py may be given less).
PROGRAM_LIMITS = RunLimits(timeout_s=10.0, max_heap_bytes=64 << 20, max_tool_calls=100)
PROGRAM_MAX_OUTPUT_TOKENS = 4000
FINGERPRINT_VERSION = "ptc1"
_NESTED_CALL_ID = re.compile(r"(.+)#(\d+)")

_INTRO = (
    "Run a JavaScript program in a fresh V8 sandbox: no file system, network, modules or "
    "require; {timeout:g} s and {heap:g} MiB limits. The input is the program's source, the "
    "body of an async function: use await at the top level. Show results with text(...) "
    "(print(...) and console.log(...) too); a value it returns is shown last. Only that "
    "output comes back to you (capped to {tokens} tokens), not what the tools return, so "
    "filter and summarize in the program. Every tool below is an async function that "
    "takes one arguments object and resolves to the tool's output string, or throws an "
    "Error whose message is the tool's error. Run independent calls together with "
    "Promise.all. Date and Math.random are fixed for the program's run. Tools:"
)


def allows(tool: dict, caller: str, parent: dict | None = None) -> bool:
    """Whether `caller` ("direct" or "programmatic") may call the tool; a namespace's
    functions inherit its `allowed_callers`."""
    callers = tool.get("allowed_callers")
    if callers is None and parent is not None:
        callers = parent.get("allowed_callers")
    return caller in (callers or ("direct",))


def has_program_tool(tools: Sequence[dict]) -> bool:
    return any(tool.get("type") == PROGRAM_TOOL_TYPE for tool in tools)


def programmable_functions(tools: Sequence[dict]) -> dict[str, tuple[str | None, dict]]:
    """The functions a program may call, by their name on `tools`: (namespace, tool)."""
    found: dict[str, tuple[str | None, dict]] = {}
    for tool in tools:
        kind = tool.get("type", "function")
        if kind == "function" and allows(tool, "programmatic"):
            found[tool["name"]] = (None, tool)
        elif kind == "namespace":
            for nested in tool.get("tools") or ():
                if nested.get("type", "function") == "function" and allows(
                    nested, "programmatic", tool
                ):
                    found[f"{tool['name']}{NAMESPACE_JOIN}{nested['name']}"] = (
                        tool["name"],
                        nested,
                    )
    return found


def program_tool(tools: Sequence[dict], limits: RunLimits = PROGRAM_LIMITS) -> dict:
    """The `program` tool as the prompt shows it (a custom tool)."""
    intro = _INTRO.format(
        timeout=limits.timeout_s,
        heap=limits.max_heap_bytes / 2**20,
        tokens=PROGRAM_MAX_OUTPUT_TOKENS,
    )
    lines = [intro]
    for name, (_, tool) in sorted(programmable_functions(tools).items()):
        parameters = tool.get("parameters") or {}
        lines.append(tool_signature(name, tool.get("description") or "", parameters))
    if len(lines) == 1:
        lines.append("(none)")
    return {"type": "custom", "name": PROGRAM_TOOL_NAME, "description": "\n".join(lines)}


# -- ids of a program's calls -------------------------------------------------------------


def nested_call_id(caller_id: str, ordinal: int) -> str:
    return f"{caller_id}#{ordinal}"


def program_caller(item: dict) -> str | None:
    """The program a `function_call` or its output belongs to (its call_id), or None."""
    if item.get("type") not in (FUNCTION_CALL, FUNCTION_CALL_OUTPUT):
        return None
    caller = item.get("caller")
    if isinstance(caller, dict) and caller.get("type") == "program":
        return str(caller.get("caller_id"))
    match = _NESTED_CALL_ID.fullmatch(str(item.get("call_id") or ""))
    return match.group(1) if match else None


def is_program_internal(item: dict) -> bool:
    """A call a program made, or its output: the model never reads these."""
    return program_caller(item) is not None


# -- the fingerprint ----------------------------------------------------------------------


class FingerprintMismatch(ValueError):
    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field  # "code" or "fingerprint": what the refusal names


def new_fingerprint(code: str, epoch_ms: int | None = None, seed: int | None = None) -> str:
    epoch_ms = int(time.time() * 1000) if epoch_ms is None else epoch_ms
    seed = secrets.randbits(32) if seed is None else seed
    return f"{FINGERPRINT_VERSION}.{epoch_ms}.{seed}.{_digest(epoch_ms, seed, code)}"


def replay_determinism(fingerprint: str, code: str) -> Determinism:
    """What a replay of `code` needs from its fingerprint; raises FingerprintMismatch when
    the fingerprint is not one, or was made for other code."""
    parts = str(fingerprint).split(".")
    if (
        len(parts) != 4
        or parts[0] != FINGERPRINT_VERSION
        or not all(p.isdigit() for p in parts[1:3])
    ):
        raise FingerprintMismatch("not a program fingerprint this server made", "fingerprint")
    epoch_ms, seed = int(parts[1]), int(parts[2])
    if parts[3] != _digest(epoch_ms, seed, code):
        raise FingerprintMismatch(
            "the program's code does not match its fingerprint: it changed since it ran", "code"
        )
    return Determinism(epoch_ms, seed)


def _digest(epoch_ms: int, seed: int, code: str) -> str:
    blob = f"{FINGERPRINT_VERSION}\x00{epoch_ms}\x00{seed}\x00{code}".encode()
    return hashlib.sha256(blob).hexdigest()[:32]
