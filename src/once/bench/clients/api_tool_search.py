"""Server-side tool search through the API, on LiveMCPBench (`api_tool_search_*`).

The catalog `once bench agent` searches (LiveMCPBench's servers plus GitHub's, read in
process) goes to the gateway as a client would send it: one `namespace` tool per server,
every function in it `defer_loading`, and a `tool_search` tool with server execution.
For each labelled task the scripted model searches with the task's question; the gateway
runs the search inside the response and answers with a `tool_search_output`. The figure
is recall@5 of the tools that output loads (bare names against the task's gold names),
over all tasks and over each half of the fixed split; the harness's ranker is measured
on the same tasks in the same run, and the two must be equal (one ranker, two callers).
"""

import asyncio
import json
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from once.agent.tools.base import ToolSpec
from once.agent.tools.catalog import spec_index
from once.bench.agent_bench.search import (
    GITHUB_SERVER,
    Task,
    default_data_dir,
    load_specs,
    load_split,
    load_tasks,
    recalls,
    split_tasks,
)
from once.bench.clients.scripted import MAX_MODEL_LEN, tool_call_block
from once.engine.scripted import ScriptedEngine
from once.gateway.model import ModelRuntime
from once.gateway.testing import serve_gateway

FINAL = "Loaded."


def catalog_tools(specs: Sequence[ToolSpec]) -> list[Any]:
    """The catalog as a request's tools: a namespace per server, its functions deferred."""
    by_namespace: dict[str, list[dict]] = {}
    for spec in specs:
        function = {
            "type": "function",
            "name": spec.name,
            "description": spec.description,
            "parameters": spec.parameters or {"type": "object", "properties": {}},
            "defer_loading": True,
        }
        by_namespace.setdefault(spec.namespace, []).append(function)
    namespaces = [
        {"type": "namespace", "name": name, "description": f"The {name} server.", "tools": tools}
        for name, tools in sorted(by_namespace.items())
    ]
    return [*namespaces, {"type": "tool_search", "execution": "server"}]


def loaded_names(output: Sequence) -> set[str]:
    names: set[str] = set()
    for item in output:
        if item.type == "tool_search_output":
            for tool in item.tools:
                nested = getattr(tool, "tools", None) or [tool]
                names.update(t.name for t in nested)
    return names


def _searching_engine(runtime: ModelRuntime, query: dict) -> ScriptedEngine:
    """Searches for `query["text"]` until a search's result is in the prompt."""
    eos = runtime.tokenizer.eos_token_id
    final_ids = runtime.builder.encode(FINAL) + [eos]
    decode = runtime.tokenizer.backend_tokenizer.decode

    def reply(request) -> list[int]:
        prompt = decode(list(request.prompt_token_ids), skip_special_tokens=False)
        if "<tools>" in prompt[prompt.rfind("<|im_start|>user") :]:
            return final_ids
        call = tool_call_block("tool_search", arguments={"query": query["text"], "limit": 5})
        return runtime.builder.encode(call) + [eos]

    return ScriptedEngine(reply, eos_token_id=eos, max_model_len=MAX_MODEL_LEN)


async def run(runtime: ModelRuntime, max_tasks: int | None = None) -> dict:
    import openai

    data_dir = default_data_dir()
    specs = load_specs(data_dir)
    livemcp_names = {s.name for s in specs if s.namespace != GITHUB_SERVER}
    tasks = load_tasks(data_dir, livemcp_names)[:max_tasks]
    parts = split_tasks(tasks, load_split())
    tools = catalog_tools(specs)
    query: dict = {}
    runtime = replace(runtime, max_model_len=MAX_MODEL_LEN)  # the scripted engine has no limit
    engine = _searching_engine(runtime, query)
    by_task: dict[str, float] = {}
    async with serve_gateway(runtime, engine) as (url, _):
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        try:
            for task in tasks:
                query["text"] = task.question
                response = await client.responses.create(
                    model=runtime.name,
                    input=task.question,
                    tools=tools,
                    store=False,
                )
                by_task[task.task_id] = len(task.gold & loaded_names(response.output)) / len(
                    task.gold
                )
        finally:
            await client.close()

    def mean(part: Sequence[Task]) -> float:
        return round(sum(by_task[t.task_id] for t in part) / len(part), 4) if part else 0.0

    harness = recalls(spec_index(specs), parts, "harness_tool_search_recall_at_5")
    api = {"api_tool_search_recall_at_5": mean(tasks)}
    api |= {f"api_tool_search_recall_at_5_{part}": mean(ts) for part, ts in parts.items()}
    same = api["api_tool_search_recall_at_5"] == harness["harness_tool_search_recall_at_5"]
    return {
        **api,
        **harness,
        "api_tool_search_equals_harness": same,
        "api_tool_search_tasks": len(tasks),
    }


if __name__ == "__main__":
    from once.gateway.testing import load_runtime

    print(json.dumps(asyncio.run(run(load_runtime())), indent=1))
