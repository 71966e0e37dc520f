"""A gateway around a scripted engine that plays one tool round trip with any client.

The engine answers by what the prompt holds, not by turn number, so clients that warm up,
retry or send side requests (a title, a compaction) still get the right answer: while no
tool result is in the prompt, the client's tool call (written as the prompt tells the
model to, `<tool_call>` blocks); after one, the final text. A tool result shows as a
`<tool_response>` turn, or as the client writes it when it writes its own (smolagents
sends its observations as user text). `ClientGateway` serves it on a
loopback port, with the client's model names aliased to the served model, and tells
afterwards what reached the gateway: requests by outcome, whether a tool result came back.
"""

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace

from once.engine.scripted import ScriptedEngine
from once.gateway.aliases import default_table
from once.gateway.config import GatewayConfig
from once.gateway.model import ModelRuntime
from once.gateway.pipeline import ResponsePipeline
from once.gateway.prompt.toolcalls import render_tool_call
from once.gateway.testing import serve_gateway

# Codex's and Claude Code's system prompts and tool lists run past SmolLM2's 8k positions:
# the scripted engine has no positions to run out of, so the bound is the gateway's.
MAX_MODEL_LEN = 131072
TOOL_RESULT_MARK = "<tool_response>"


def tool_call_block(name: str, **payload) -> str:
    """A call as the prompt asks the model to write it (`arguments`, or a raw `input`)."""
    ((key, value),) = payload.items()
    return render_tool_call(name, value, key)


def round_trip_engine(
    runtime: ModelRuntime,
    call_text: str,
    final_text: str,
    result_mark: str = TOOL_RESULT_MARK,
    steps: Sequence[tuple[str, str]] = (),
) -> ScriptedEngine:
    """The model of a round trip: the final text once a tool's result is in the prompt,
    else the reply of the last step whose mark the prompt holds, else the first call."""
    eos = runtime.tokenizer.eos_token_id
    script = [("", call_text), *steps, (result_mark, final_text)]
    ids = [(mark, runtime.builder.encode(text) + [eos]) for mark, text in script]
    decode = runtime.tokenizer.backend_tokenizer.decode

    def reply(request) -> list[int]:
        prompt = decode(list(request.prompt_token_ids), skip_special_tokens=False)
        return next(reply_ids for mark, reply_ids in reversed(ids) if mark in prompt)

    return ScriptedEngine(reply, eos_token_id=eos, max_model_len=MAX_MODEL_LEN)


@dataclass
class ClientGateway:
    url: str
    gateway: ResponsePipeline
    engine: ScriptedEngine
    runtime: ModelRuntime
    result_mark: str = TOOL_RESULT_MARK  # how a tool's result shows in the prompt

    def outcomes(self) -> dict[str, int]:
        """Responses by outcome (`response.completed`, `error`, ...), every transport."""
        counts: dict[str, int] = {}
        for family in self.gateway.metrics.requests.collect():
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    outcome = sample.labels["outcome"]
                    counts[outcome] = counts.get(outcome, 0) + int(sample.value)
        return counts

    def tool_result_returned(self, marker: str) -> bool:
        """Whether a prompt holds a tool result that says `marker` (the tool really ran)."""
        decode = self.runtime.tokenizer.backend_tokenizer.decode
        for request in self.engine.requests:
            prompt = decode(list(request.prompt_token_ids), skip_special_tokens=False)
            start = prompt.rfind(self.result_mark)
            if start != -1 and marker in prompt[start:]:
                return True
        return False


@contextlib.asynccontextmanager
async def client_gateway(
    runtime: ModelRuntime,
    call_text: str,
    final_text: str,
    aliases: tuple[str, ...] = (),
    result_mark: str = TOOL_RESULT_MARK,
    steps: Sequence[tuple[str, str]] = (),
) -> AsyncIterator[ClientGateway]:
    runtime = replace(runtime, max_model_len=MAX_MODEL_LEN)
    engine = round_trip_engine(runtime, call_text, final_text, result_mark, steps)
    table = {**default_table(runtime.name), **{name: runtime.name for name in aliases}}
    config = GatewayConfig(store="memory", verify_every=1, aliases=table)
    async with serve_gateway(runtime, engine, config) as (url, gateway):
        yield ClientGateway(url, gateway, engine, runtime, result_mark)
