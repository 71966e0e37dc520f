"""The Python clients: the `openai` and `anthropic` SDKs, the `openai-agents` SDK,
mini-swe-agent (through LiteLLM) and smolagents, each driving one tool round trip.

Each runner takes the gateway's URL and a workspace and returns what the client ended
with (its final text, or the exception it raised, verbatim). The tool each one calls is a
real function of the client's own kind (an SDK function tool, mini-swe-agent's bash,
smolagents' tool) that lists the workspace, so the round trip is real on both sides.
"""

import asyncio
import json
import os
import subprocess
from pathlib import Path
from typing import Any

API_KEY = "sk-once-client-test"


def list_files(workspace: Path) -> str:
    return "\n".join(sorted(p.name for p in workspace.iterdir()))


LIST_FILES_TOOL: Any = {
    "type": "function",
    "name": "list_files",
    "description": "List the files of the workspace.",
    "parameters": {"type": "object", "properties": {}},
    "strict": False,
}


def replayed_with_outputs(response, calls, workspace: Path) -> list[dict]:
    """The response's output items sent back, then one listing of the workspace per call."""
    outputs = [
        {"type": "function_call_output", "call_id": call.call_id, "output": list_files(workspace)}
        for call in calls
    ]
    return [item.model_dump(exclude_none=True) for item in response.output] + outputs


async def openai_responses(base_url: str, workspace: Path, model: str) -> str:
    """The Responses API with a function tool, streamed, output items fed back as input."""
    import openai

    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=API_KEY) as client:
        items: list = [{"role": "user", "content": "Which files are here?"}]
        for _ in range(3):
            async with client.responses.stream(
                model=model, input=items, tools=[LIST_FILES_TOOL], store=False
            ) as stream:
                response = await stream.get_final_response()
            calls = [item for item in response.output if item.type == "function_call"]
            if not calls:
                return response.output_text
            items += replayed_with_outputs(response, calls, workspace)
    raise RuntimeError("no final answer in 3 turns")


async def openai_chat(base_url: str, workspace: Path, model: str) -> str:
    """Chat Completions with a tool, streamed with the SDK's helper, parallel calls allowed."""
    import openai

    tool: Any = {
        "type": "function",
        "function": {k: v for k, v in LIST_FILES_TOOL.items() if k not in ("type", "strict")},
    }
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=API_KEY) as client:
        messages: list = [{"role": "user", "content": "Which files are here?"}]
        for _ in range(3):
            async with client.chat.completions.stream(
                model=model, messages=messages, tools=[tool]
            ) as stream:
                completion = await stream.get_final_completion()
            message = completion.choices[0].message
            if not message.tool_calls:
                return message.content or ""
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                messages.append(
                    {"role": "tool", "tool_call_id": call.id, "content": list_files(workspace)}
                )
    raise RuntimeError("no final answer in 3 turns")


async def anthropic_messages(base_url: str, workspace: Path, model: str) -> str:
    """The Messages API with a tool, streamed, tool_use answered by tool_result."""
    import anthropic

    tool: Any = {
        "name": "list_files",
        "description": LIST_FILES_TOOL["description"],
        "input_schema": {"type": "object", "properties": {}},
    }
    async with anthropic.AsyncAnthropic(base_url=base_url, api_key=API_KEY) as client:
        messages: list = [{"role": "user", "content": "Which files are here?"}]
        for _ in range(3):
            async with client.messages.stream(
                model=model, max_tokens=512, messages=messages, tools=[tool]
            ) as stream:
                message = await stream.get_final_message()
            uses = [block for block in message.content if block.type == "tool_use"]
            if not uses:
                return "".join(b.text for b in message.content if b.type == "text")
            messages.append(
                {
                    "role": "assistant",
                    "content": [b.model_dump(exclude_none=True) for b in message.content],
                }
            )
            results = [
                {"type": "tool_result", "tool_use_id": use.id, "content": list_files(workspace)}
                for use in uses
            ]
            messages.append({"role": "user", "content": results})
    raise RuntimeError("no final answer in 3 turns")


async def openai_agents(base_url: str, workspace: Path, model: str) -> str:
    """The openai-agents SDK: an Agent with a function tool, run by its Runner."""
    from agents import function_tool

    @function_tool
    def list_workspace() -> str:
        """List the files of the workspace."""
        return list_files(workspace)

    return await _run_agent(base_url, model, [list_workspace])


async def openai_agents_tool_search(base_url: str, workspace: Path, model: str) -> str:
    """openai-agents with the hosted tool search: its function tool deferred, found by the
    gateway's search inside the response, then called."""
    from agents import ToolSearchTool, function_tool

    @function_tool(defer_loading=True)
    def list_workspace() -> str:
        """List the files of the workspace."""
        return list_files(workspace)

    return await _run_agent(base_url, model, [ToolSearchTool(), list_workspace])


async def openai_agents_programs(base_url: str, workspace: Path, model: str) -> str:
    """openai-agents with programmatic tool calling: the model's program calls the agent's
    function, which the SDK runs (the response ends on the program's call), and the
    program resumes with its output."""
    from agents import ProgrammaticToolCallingTool, function_tool

    @function_tool(allowed_callers=["programmatic"])
    def list_workspace() -> str:
        """List the files of the workspace."""
        return list_files(workspace)

    return await _run_agent(base_url, model, [ProgrammaticToolCallingTool(), list_workspace])


async def _run_agent(base_url: str, model: str, tools: list) -> str:
    import openai
    from agents import Agent, OpenAIResponsesModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)  # its traces go to OpenAI's servers
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=API_KEY)
    agent = Agent(
        name="lister",
        instructions="Answer with the tools you have.",
        tools=tools,
        model=OpenAIResponsesModel(model=model, openai_client=client),
    )
    try:
        result = await Runner.run(agent, "Which files are here?", max_turns=4)
    finally:
        await client.close()
    return str(result.final_output)


async def openai_structured(base_url: str, workspace: Path, model: str) -> str:
    """The `openai` SDK's structured-output helpers: `responses.parse` with a pydantic
    function tool (its arguments parsed into the model) and a pydantic `text_format` for
    the final answer."""
    import openai
    from openai.lib._tools import pydantic_responses_function_tool
    from pydantic import BaseModel

    class ListFiles(BaseModel):
        """List the files of the workspace."""

        folder: str

    class Listing(BaseModel):
        files: list[str]

    tool = pydantic_responses_function_tool(ListFiles, name="list_files")
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=API_KEY) as client:
        items: list = [{"role": "user", "content": "Which files are here? Answer as JSON."}]
        for _ in range(3):
            response = await client.responses.parse(
                model=model, input=items, tools=[tool], text_format=Listing, store=False
            )
            calls = [item for item in response.output if item.type == "function_call"]
            if not calls:
                listing = response.output_parsed
                if not isinstance(listing, Listing):
                    raise RuntimeError(f"no parsed answer: {response.output_text!r}")
                return ", ".join(listing.files)
            if not all(isinstance(call.parsed_arguments, ListFiles) for call in calls):
                raise RuntimeError("the call's arguments did not parse into ListFiles")
            items += replayed_with_outputs(response, calls, workspace)
    raise RuntimeError("no final answer in 3 turns")


def _mini_swe_agent(base_url: str, workspace: Path, model: str) -> str:
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.config import get_config_from_spec
    from minisweagent.environments.local import LocalEnvironment
    from minisweagent.models.litellm_model import LitellmModel

    config = get_config_from_spec("default")
    llm = LitellmModel(
        model_name=f"openai/{model}",
        model_kwargs={"api_base": f"{base_url}/v1", "api_key": API_KEY, "drop_params": True},
        cost_tracking="ignore_errors",
    )
    environment = LocalEnvironment(cwd=str(workspace))
    agent = DefaultAgent(llm, environment, **{**config.get("agent", {}), "step_limit": 4})
    result = agent.run("List the files of the repository, then submit.")
    if result.get("exit_status") != "Submitted":
        raise RuntimeError(f"mini-swe-agent ended with {result.get('exit_status')!r}")
    return str(result.get("submission", ""))


async def mini_swe_agent(base_url: str, workspace: Path, model: str) -> str:
    """mini-swe-agent's own loop over LiteLLM's Chat Completions, bash run locally."""
    os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
    return await asyncio.to_thread(_mini_swe_agent, base_url, workspace, model)


def _smolagents(base_url: str, workspace: Path, model: str) -> str:
    from smolagents import OpenAIServerModel, ToolCallingAgent, tool

    @tool
    def list_workspace() -> str:
        """List the files of the workspace."""
        return list_files(workspace)

    llm = OpenAIServerModel(model_id=model, api_base=f"{base_url}/v1", api_key=API_KEY)
    agent = ToolCallingAgent(tools=[list_workspace], model=llm, max_steps=4, verbosity_level=0)
    return str(agent.run("Which files are here?"))


async def smolagents(base_url: str, workspace: Path, model: str) -> str:
    """smolagents' ToolCallingAgent on its OpenAI-compatible model class."""
    return await asyncio.to_thread(_smolagents, base_url, workspace, model)


def git_workspace(path: Path) -> Path:
    """A small repository for the agents to look at."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "hello.txt").write_text("hello\n")
    (path / "README.md").write_text("# demo\n")
    subprocess.run(["git", "init", "-q"], cwd=path, check=False)
    return path


def tool_arguments(**arguments) -> str:
    return json.dumps(arguments)
