"""The tool registry: one place where every call is validated, authorized and recorded.

Model calls and Code Mode's nested calls both go through `ToolRegistry.call`:
unknown tool -> error result naming the known ones; arguments that are not JSON or do
not validate against the tool's *full* schema (the prompt may carry a compressed one)
-> error result carrying the full schema; the approval policy (live harness state) ->
a denial is an error result; the tool runs; exceptions become error results; every
call is appended to the transcript.
"""

import json
import time
from collections.abc import Iterable

import jsonschema

from once.agent.tools.base import Tool, ToolCallRecord, ToolContext, ToolResult, ToolSpec


class ToolRegistry:
    def __init__(self, tools: Iterable[Tool] | None = None):
        self._tools: dict[str, Tool] = {}
        for tool in tools or ():
            self.register(tool)

    def register(self, tool: Tool) -> None:
        name = tool.spec.function_name
        if name in self._tools:
            raise ValueError(f"tool {tool.spec.display_name!r} is registered twice")
        _validator_class(tool.spec.parameters).check_schema(tool.spec.parameters)
        self._tools[name] = tool

    def get(self, function_name: str) -> Tool | None:
        return self._tools.get(function_name)

    def __contains__(self, function_name: str) -> bool:
        return function_name in self._tools

    def specs(self) -> list[ToolSpec]:
        """Every spec, sorted by namespace then name: one order whatever the registration."""
        return sorted((t.spec for t in self._tools.values()), key=lambda s: (s.namespace, s.name))

    async def call(
        self,
        function_name: str,
        arguments: str | dict,
        ctx: ToolContext,
        *,
        parent: str | None = None,
    ) -> ToolResult:
        start = time.perf_counter()
        tool = self._tools.get(function_name)
        args: dict = {}
        if tool is None:
            known = ", ".join(sorted(self._tools)) or "none"
            result = ToolResult(f"unknown tool {function_name!r}; known tools: {known}", True)
        else:
            args, refusal = _parse_arguments(arguments, tool.spec)
            result = refusal if refusal is not None else await self._authorized_run(tool, args, ctx)
        ctx.transcript.append(
            ToolCallRecord(function_name, args, result, time.perf_counter() - start, parent)
        )
        return result

    async def _authorized_run(self, tool: Tool, args: dict, ctx: ToolContext) -> ToolResult:
        if ctx.policy is not None:
            decision = await ctx.policy.authorize(tool.spec, args, ctx)
            if not decision.allowed:
                return ToolResult(f"not run: {decision.reason}", True, {"denied": True})
        try:
            return await tool(args, ctx)
        except Exception as e:  # noqa: BLE001 - a broken tool is a result the model sees
            name = tool.spec.display_name
            return ToolResult(f"tool {name} failed: {type(e).__name__}: {e}", True)


def _parse_arguments(arguments: str | dict, spec: ToolSpec) -> tuple[dict, ToolResult | None]:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            return {}, ToolResult(f"arguments are not valid JSON: {e}", True)
    if not isinstance(arguments, dict):
        return {}, ToolResult("arguments must be a JSON object", True)
    validator = _validator_class(spec.parameters)(spec.parameters)
    errors = sorted(validator.iter_errors(arguments), key=str)
    if errors:
        where = "/".join(str(p) for p in errors[0].absolute_path) or "(root)"
        schema = json.dumps(spec.parameters, sort_keys=True)
        message = (
            f"invalid arguments for {spec.display_name} at {where}: {errors[0].message}\n"
            f"full schema: {schema}"
        )
        return arguments, ToolResult(message, True)
    return arguments, None


def _validator_class(schema: dict):
    # A schema that declares its draft (`$schema`, e.g. draft-04 in MCP catalogs) is read
    # by that draft's rules; the rest by the current one.
    return jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
