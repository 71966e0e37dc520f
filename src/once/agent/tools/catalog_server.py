"""A real MCP server that serves the tools of a catalog file, for tests and benchmarks.

The harness discovers recorded catalogs (LiveMCPBench's `tools.json`, GitHub's tool
snapshots) exactly as it discovers a user's servers: over MCP, through the official SDK.
`tools/list` answers with the recorded names, descriptions and input schemas verbatim;
`tools/call` checks the arguments against the tool's schema (a violation is an `isError`
result, as a real server's would be) and answers with a canned, deterministic text after
an optional delay (Code Mode benchmarks need tools that take time).

It is built on the SDK's low-level `Server` rather than `MCPServer`: `MCPServer` derives
each input schema from a Python signature, while a catalog server must publish the
recorded schemas byte for byte.

    python -m once.agent.tools.catalog_server --catalog tools.json --server fetch   # stdio
    python -m once.agent.tools.catalog_server --catalog tools.json --http 0         # all, HTTP

With `--http` every server of the catalog is mounted at `/<server>/mcp` in one process
(streamable HTTP), and the line `listening http://127.0.0.1:PORT` goes to stdout.
"""

import argparse
import asyncio
import contextlib
import json
import socket
import sys
from pathlib import Path

import jsonschema
import mcp_types as types
from mcp.server.lowlevel import Server

# A catalog: server name -> the tools of its `tools/list`, as recorded (MCP tool dicts).
Catalog = dict[str, list[dict]]


def load_catalog(path: str | Path, server: str | None = None) -> Catalog:
    """Read a catalog file: LiveMCPBench's `tools.json`, a folder of one-tool files
    (GitHub's `__toolsnaps__/*.snap`), or `{"server": [tool, ...]}`.

    A folder holds one server's tools and `server` names it (default: the folder's name).
    """
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".snap", ".json"))
        tools = [json.loads(p.read_text(encoding="utf-8")) for p in files]
        return {server or path.name: tools}
    data = json.loads(path.read_text(encoding="utf-8"))
    catalog: Catalog = {}
    if isinstance(data, list):  # LiveMCPBench: [{name, description, tools: {key: {tools}}}]
        for entry in data:
            for key, listing in (entry.get("tools") or {}).items():
                catalog.setdefault(key, []).extend(listing.get("tools") or [])
    elif isinstance(data, dict) and all(isinstance(v, list) for v in data.values()):
        catalog = {name: list(tools) for name, tools in data.items()}
    else:
        raise ValueError(f"{path}: not a catalog (a server list or {{server: [tools]}})")
    if server is not None:
        if server not in catalog:
            raise ValueError(f"{path}: no server {server!r}; servers: {', '.join(sorted(catalog))}")
        return {server: catalog[server]}
    return catalog


def canned_result(server: str, tool: str, arguments: dict, size_chars: int = 0) -> str:
    """Deterministic text; `size_chars` pads it with numbered rows to about that size, so
    a benchmark's tools can answer with what a real API returns (tables of data)."""
    args = json.dumps(arguments, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    text = f"{server}.{tool} ok {args}"
    row = 0
    while len(text) < size_chars:
        text += f"\nrow {row}: value={(row * 7919) % 1000}.{row % 100:02d} status=ok"
        row += 1
    return text


def build_server(
    name: str, tools: list[dict], delay_ms: float = 0.0, result_chars: int = 0
) -> Server:
    """An MCP server answering `tools/list` with `tools` and `tools/call` with a canned text."""
    listed = [
        types.Tool(
            name=tool["name"],
            description=tool.get("description") or "",
            input_schema=tool.get("inputSchema") or {"type": "object", "properties": {}},
            annotations=tool.get("annotations") or None,
        )
        for tool in tools
    ]
    by_name = {tool.name: tool for tool in listed}

    async def list_tools(ctx, params) -> types.ListToolsResult:
        return types.ListToolsResult(tools=listed)

    async def call_tool(ctx, params: types.CallToolRequestParams) -> types.CallToolResult:
        tool = by_name.get(params.name)
        arguments = params.arguments or {}
        if tool is None:
            return _error(f"unknown tool {params.name!r}")
        validator = jsonschema.validators.validator_for(tool.input_schema)(tool.input_schema)
        errors = sorted(validator.iter_errors(arguments), key=str)
        if errors:
            return _error(f"invalid arguments for {params.name}: {errors[0].message}")
        if delay_ms > 0:
            await asyncio.sleep(delay_ms / 1000)
        text = canned_result(name, params.name, arguments, result_chars)
        return types.CallToolResult(content=[types.TextContent(type="text", text=text)])

    return Server(name, version="1", on_list_tools=list_tools, on_call_tool=call_tool)


def _error(text: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)], is_error=True)


async def serve_stdio(server: Server) -> None:
    from mcp.server.stdio import stdio_server

    async with stdio_server() as (read_stream, write_stream):
        await server.run(read_stream, write_stream, server.create_initialization_options())


async def serve_http(servers: dict[str, Server], host: str = "127.0.0.1", port: int = 0) -> None:
    """Every server at `/<name>/mcp` of one streamable-HTTP app; port 0 picks a free one."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.routing import Mount

    # Each server's app owns a session manager that must run for the app's lifetime;
    # Starlette does not run a mounted app's lifespan, so the parent runs them all.
    mounts = [
        Mount(f"/{name}", app=server.streamable_http_app(streamable_http_path="/mcp", host=host))
        for name, server in sorted(servers.items())
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        async with contextlib.AsyncExitStack() as stack:
            for server in servers.values():
                await stack.enter_async_context(server.session_manager.run())
            yield

    app = Starlette(routes=mounts, lifespan=lifespan)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    config = uvicorn.Config(app, log_level="warning", lifespan="on")
    print(f"listening http://{host}:{sock.getsockname()[1]}", flush=True)
    await uvicorn.Server(config).serve(sockets=[sock])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="once.agent.tools.catalog_server", description=__doc__)
    parser.add_argument("--catalog", required=True, help="tools.json, a .snap folder, ...")
    parser.add_argument("--server", help="the server to serve (stdio needs one)")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="time each call takes")
    parser.add_argument(
        "--result-chars", type=int, default=0, help="pad each result to about this size"
    )
    parser.add_argument("--http", type=int, metavar="PORT", help="streamable HTTP on PORT")
    parser.add_argument("--list-servers", action="store_true", help="print server names")
    args = parser.parse_args(argv)
    try:
        catalog = load_catalog(args.catalog, args.server)
    except (OSError, ValueError) as e:
        print(f"catalog_server: {e}", file=sys.stderr)
        return 2
    if args.list_servers:
        print("\n".join(sorted(catalog)))
        return 0
    servers = {
        name: build_server(name, tools, args.delay_ms, args.result_chars)
        for name, tools in catalog.items()
    }
    if args.http is not None:
        asyncio.run(serve_http(servers, port=args.http))
    elif len(servers) != 1:
        print("catalog_server: stdio serves one server: pass --server", file=sys.stderr)
        return 2
    else:
        asyncio.run(serve_stdio(next(iter(servers.values()))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
