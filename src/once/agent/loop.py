"""The agent loop (Codex / mini-swe-agent): call the model, run its tool calls, repeat.

Each turn sends instructions + the fixed tool list + the whole history as one full
request; the transport decides what actually goes on the wire (only the new items over
WebSocket). History is append-only: a response's output items are appended exactly as
received and every tool result follows as a `function_call_output` (plus a
`tool_search_output` item when a search loaded tools), so each request extends the last
and the prompt prefix never changes. The loop ends at a reply without tool calls, or at
the step or token budget. Compaction, when the model's context passes a budget, asks the
model for a handoff summary and starts a new chain from it.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from once.agent.doctor import CacheDoctor
from once.agent.pauses import ToolPauseEstimates
from once.agent.prefix import canonical_tools, check_instructions
from once.agent.tools.base import ToolContext, ToolResult
from once.agent.tools.discovery import TOOL_SEARCH_NAME, DeferredTools
from once.agent.tools.registry import ToolRegistry
from once.agent.transport.base import EventCallback, Transport

# Called after each tool call with the model's function_call item and the result.
ToolCallback = Callable[[dict, ToolResult], None]

HANDOFF_PROMPT = (
    "Your context is nearly full. Write a handoff summary for the engineer who continues "
    "this task: what the task is, what you found, what you changed, what is left. "
    "Do not call tools."
)


@dataclass(frozen=True)
class AgentConfig:
    model: str
    instructions: str
    max_steps: int = 30
    max_output_tokens: int | None = None
    max_total_tokens: int | None = None  # input + output over the task; None: unlimited
    temperature: float | None = None
    store: bool = False
    prompt_cache_key: str | None = None  # the session: keeps it on one replica
    compact_at_tokens: int | None = None  # prompt size that triggers compaction
    # Send the tools' running times as a KV hint (agent/pauses.py); needs prompt_cache_key.
    pause_hints: bool = True


@dataclass
class CostSummary:
    model_calls: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    bytes_sent: int = 0
    incremental_calls: int = 0
    full_calls: int = 0
    tool_calls: int = 0
    compactions: int = 0

    def line(self) -> str:
        return (
            f"{self.model_calls} model calls, {self.input_tokens} tokens in "
            f"({self.cached_tokens} cached), {self.output_tokens} out, {self.tool_calls} tool "
            f"calls, {self.bytes_sent} bytes sent ({self.incremental_calls} incremental, "
            f"{self.full_calls} full requests)"
        )


@dataclass
class AgentResult:
    final_text: str
    stopped: str  # "answer" | "max_steps" | "max_tokens"
    history: list[dict]
    cost: CostSummary
    usages: list[dict] = field(default_factory=list)  # per model call


class Agent:
    def __init__(
        self,
        transport: Transport,
        registry: ToolRegistry,
        ctx: ToolContext,
        config: AgentConfig,
        *,
        tools: list[dict] | None = None,
        on_event: EventCallback | None = None,
        on_tool: ToolCallback | None = None,
        doctor: CacheDoctor | None = None,
        discovery: DeferredTools | None = None,
    ):
        self.transport = transport
        self.registry = registry
        self.ctx = ctx
        ctx.registry = registry
        self.config = config
        # Fixed for the whole session (discovery appends tools at the tail, never here),
        # in the one canonical order; instructions free of per-run values (prefix.py).
        check_instructions(config.instructions)
        self.tools = canonical_tools(tools if tools is not None else registry.specs())
        self.on_event = on_event
        self.on_tool = on_tool or (lambda call, result: None)
        self.doctor = doctor  # a CacheDoctor: names what broke the prefix, tracks hits
        self.discovery = discovery  # DeferredTools: tool_search answers become tail items
        self.history: list[dict] = []
        self.cost = CostSummary()
        self.usages: list[dict] = []
        self.pauses = ToolPauseEstimates()

    def request(self) -> dict:
        body = {
            "model": self.config.model,
            "instructions": self.config.instructions,
            "tools": self.tools,
            "input": list(self.history),
            "store": self.config.store,
        }
        for key in ("max_output_tokens", "temperature", "prompt_cache_key"):
            if getattr(self.config, key) is not None:
                body[key] = getattr(self.config, key)
        if self.config.pause_hints and self.config.prompt_cache_key and self.pauses.seconds:
            body["metadata"] = self.pauses.metadata()
        return body

    async def run(self, task: str) -> AgentResult:
        """One task (or, interactively, one more user message in the same session)."""
        self.history.append({"type": "message", "role": "user", "content": task})
        final_text, stopped = "", "max_steps"
        for _ in range(self.config.max_steps):
            if self._over_token_budget():
                stopped = "max_tokens"
                break
            response = await self._call_model()
            output = response.get("output") or []
            self.history.extend(output)
            calls = [item for item in output if item.get("type") == "function_call"]
            final_text = _output_text(output)
            if not calls:
                stopped = "answer"
                break
            for call in calls:
                await self._run_tool(call)
            await self._maybe_compact(response)
        self._sync_transport_stats()
        return AgentResult(final_text, stopped, self.history, self.cost, self.usages)

    async def _call_model(self) -> dict:
        request = self.request()
        if self.doctor is not None:
            self.doctor.observe(request)
        response = await self.transport.create(request, self.on_event)
        self.cost.model_calls += 1
        usage = response.get("usage") or {}
        self.usages.append(usage)
        self.cost.input_tokens += usage.get("input_tokens", 0)
        self.cost.output_tokens += usage.get("output_tokens", 0)
        self.cost.cached_tokens += (usage.get("input_tokens_details") or {}).get("cached_tokens", 0)
        if self.doctor is not None:
            self.doctor.record_output(response.get("output") or [])
            self.doctor.record_usage(usage)
        return response

    async def _run_tool(self, call: dict) -> None:
        self.ctx.call_id = call.get("call_id")
        started = time.monotonic()
        result = await self.registry.call(call.get("name", ""), call.get("arguments", ""), self.ctx)
        self.pauses.observe(call.get("name", ""), time.monotonic() - started)
        self.cost.tool_calls += 1
        self.on_tool(call, result)
        call_id = call.get("call_id")
        if self.discovery is not None and call.get("name") == TOOL_SEARCH_NAME:
            # Discovered tools join the tail as a tool_search_output item, never `tools`.
            self.history.append(self.discovery.output_item(call_id, result))
        else:
            self.history.append(
                {"type": "function_call_output", "call_id": call_id, "output": result.output}
            )

    async def _maybe_compact(self, response: dict) -> None:
        budget = self.config.compact_at_tokens
        used = (response.get("usage") or {}).get("input_tokens", 0)
        if budget is None or used < budget:
            return
        self.history.append({"type": "message", "role": "user", "content": HANDOFF_PROMPT})
        summary = _output_text((await self._call_model()).get("output") or [])
        users = [
            item
            for item in self.history
            if item.get("type") == "message"
            and item.get("role") == "user"
            and item.get("content") != HANDOFF_PROMPT
        ]
        loaded = [item for item in self.history if item.get("type") == "tool_search_output"]
        # A new chain: the task's user messages, the tools loaded so far, the handoff.
        self.history = [
            *users[-3:],
            *loaded,
            {"type": "message", "role": "user", "content": f"Handoff summary:\n{summary}"},
        ]
        self.cost.compactions += 1

    def _over_token_budget(self) -> bool:
        limit = self.config.max_total_tokens
        return limit is not None and self.cost.input_tokens + self.cost.output_tokens >= limit

    def _sync_transport_stats(self) -> None:
        stats = self.transport.stats
        self.cost.bytes_sent = stats.bytes_sent
        self.cost.incremental_calls = stats.incremental_calls
        self.cost.full_calls = stats.full_calls


def _output_text(output: list[dict]) -> str:
    parts = []
    for item in output:
        if item.get("type") == "message":
            for part in item.get("content") or ():
                if part.get("type") == "output_text":
                    parts.append(part.get("text", ""))
    return "".join(parts)
