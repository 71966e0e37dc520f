"""Structured outputs through the API on the real model (SmolLM2), sampled.

N JSON-schema responses (`text.format` json_schema, temperature 1: every one a different
sample), N forced calls of a strict function and N forced calls of custom tools with a
Lark grammar (`tool_choice` naming the tool), each through the gateway to the in-process
engine, which enforces the grammar the gateway derives (constraints.py, engine/grammar.py).
Each output is checked by a reference implementation, not by the library that enforced
it: JSON with `jsonschema` against the schema asked for, a custom tool's input with the
`lark` package's Earley parser on the tool's grammar. The figure is the valid fraction.
"""

import asyncio
import json
import time
from typing import Any

import jsonschema
import lark
import openai

from once.gateway.testing import load_runtime, serve_gateway
from once.model_files import DEFAULT_MODEL

SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 40},
            "population": {"type": "integer", "minimum": 0, "maximum": 100000000},
            "size": {"enum": ["small", "medium", "large"]},
        },
        "required": ["city", "population", "size"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "steps": {
                "type": "array",
                "items": {"type": "string", "maxLength": 40},
                "maxItems": 3,
            }
        },
        "required": ["steps"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "reason": {"type": "string", "maxLength": 60}},
        "required": ["ok", "reason"],
        "additionalProperties": False,
    },
]
PROMPTS = ["Describe a city as JSON.", "List the steps to make tea as JSON.", "Is 7 prime? JSON."]
LOOKUP: dict[str, Any] = {
    "type": "function",
    "name": "lookup",
    "description": "Look up a word in the dictionary.",
    "parameters": {
        "type": "object",
        "properties": {
            "word": {"type": "string", "maxLength": 30},
            "limit": {"type": "integer", "minimum": 1, "maximum": 100},
        },
        "required": ["word", "limit"],
        "additionalProperties": False,
    },
    "strict": True,
}
# Grammars in the dialect Lark and llguidance share, bounded so a sample fits the budget.
GRAMMARS = {
    "edit": """start: verb " " target
verb: "add" | "remove" | "rename"
target: NAME ("," NAME) ~ 0..2
NAME: /[a-z][a-z0-9_]{0,11}/
""",
    "query": """start: "SELECT " columns " FROM " NAME (" WHERE " NAME " = " NUMBER)?
columns: NAME (", " NAME) ~ 0..3
NAME: /[a-z_]{1,12}/
NUMBER: /[0-9]{1,6}/
""",
}
GRAMMAR_PROMPTS = {"edit": "Add a file named notes.", "query": "Select the names of all users."}


async def _json_response(client, index: int) -> bool:
    schema = SCHEMAS[index % len(SCHEMAS)]
    response = await client.responses.create(
        model=DEFAULT_MODEL,
        input=PROMPTS[index % len(PROMPTS)],
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema}},
        temperature=1.0,
        max_output_tokens=200,
    )
    return _valid(response.output_text, schema)


async def _forced_call(client, index: int) -> bool:
    response = await client.responses.create(
        model=DEFAULT_MODEL,
        input=f"Look up word number {index}.",
        tools=[LOOKUP],
        tool_choice={"type": "function", "name": "lookup"},
        temperature=1.0,
        max_output_tokens=200,
    )
    calls = [item for item in response.output if item.type == "function_call"]
    return bool(calls) and _valid(calls[0].arguments, LOOKUP["parameters"])


async def _grammar_call(client, index: int) -> bool:
    name = sorted(GRAMMARS)[index % len(GRAMMARS)]
    tool = {
        "type": "custom",
        "name": name,
        "description": f"Run one {name} command.",
        "format": {"type": "grammar", "syntax": "lark", "definition": GRAMMARS[name]},
    }
    response = await client.responses.create(
        model=DEFAULT_MODEL,
        input=GRAMMAR_PROMPTS[name],
        tools=[tool],
        tool_choice={"type": "custom", "name": name},
        temperature=1.0,
        max_output_tokens=200,
    )
    calls = [item for item in response.output if item.type == "custom_tool_call"]
    if not calls:
        return False
    try:
        lark.Lark(GRAMMARS[name], parser="earley", lexer="dynamic").parse(calls[0].input)
    except lark.LarkError:
        return False
    return True


def _valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


async def run(
    num_json: int = 50, num_calls: int = 20, num_grammar: int = 20, concurrency: int = 8
) -> dict:
    from once.engine.async_engine import AsyncEngine
    from once.engine.config import EngineConfig

    started = time.perf_counter()
    engine = AsyncEngine.from_config(EngineConfig(model=DEFAULT_MODEL, max_num_seqs=concurrency))
    runtime = load_runtime()
    limit = asyncio.Semaphore(concurrency)

    async def bounded(fn, index: int) -> bool:
        async with limit:
            return await fn(client, index)

    try:
        async with serve_gateway(runtime, engine) as (url, _):
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", timeout=600)
            json_ok = await asyncio.gather(*(bounded(_json_response, i) for i in range(num_json)))
            call_ok = await asyncio.gather(*(bounded(_forced_call, i) for i in range(num_calls)))
            grammar_ok = await asyncio.gather(
                *(bounded(_grammar_call, i) for i in range(num_grammar))
            )
            await client.close()
    finally:
        await engine.close()
    return {
        "structured_json_responses": num_json,
        "structured_json_valid": sum(json_ok),
        "structured_forced_calls": num_calls,
        "structured_forced_calls_valid": sum(call_ok),
        "structured_grammar_calls": num_grammar,
        "structured_grammar_calls_valid": sum(grammar_ok),
        "structured_valid_fraction": (sum(json_ok) + sum(call_ok) + sum(grammar_ok))
        / (num_json + num_calls + num_grammar),
        "structured_wall_s": round(time.perf_counter() - started, 1),
    }
