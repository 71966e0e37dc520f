import asyncio
import json
import sys
import time
from pathlib import Path

import pytest

from once.agent.tools.base import ToolContext
from once.agent.tools.catalog import ToolCatalog
from once.agent.tools.catalog_server import canned_result, load_catalog
from once.agent.tools.mcp_client import (
    McpConnections,
    McpServerConfig,
    namespace_for,
    python_server,
)
from once.agent.tools.registry import ToolRegistry

SERVER_MODULE = "once.agent.tools.catalog_server"

WEATHER = {
    "name": "get_weather",
    "description": "Current weather of a city.",
    "inputSchema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "description": "City name"},
            "units": {"type": "string", "enum": ["metric", "imperial"]},
        },
        "required": ["city"],
        "additionalProperties": False,
    },
}
ECHO = {
    "name": "echo",
    "description": "Echo the text back.",
    "inputSchema": {"type": "object", "properties": {"text": {"type": "string"}}},
}
# LiveMCPBench's layout: a list of servers, each with {key: {tools: [...]}}.
LIVEMCP_STYLE = [
    {"name": "Weather Server", "tools": {"weather": {"tools": [WEATHER]}}},
    {"name": "Echo Server", "tools": {"echo srv": {"tools": [ECHO]}}},
]


@pytest.fixture
def catalog_file(tmp_path) -> Path:
    path = tmp_path / "tools.json"
    path.write_text(json.dumps(LIVEMCP_STYLE))
    return path


def server(name: str, catalog_file: Path) -> McpServerConfig:
    return python_server(name, SERVER_MODULE, "--catalog", str(catalog_file), "--server", name)


def ctx(tmp_path) -> ToolContext:
    return ToolContext(workspace=tmp_path)


async def test_stdio_round_trip_lists_real_schemas_and_calls(catalog_file, tmp_path):
    configs = [server("weather", catalog_file), server("echo srv", catalog_file)]
    async with McpConnections(configs) as mcp:  # both subprocesses start at once
        echo, weather = mcp.tools()
        assert [echo.spec.display_name, weather.spec.display_name] == [
            "echo-srv.echo",
            "weather.get_weather",
        ]
        assert weather.spec.function_name == "weather__get_weather"
        assert weather.spec.parameters == WEATHER["inputSchema"]  # verbatim, not re-derived
        assert weather.spec.description == WEATHER["description"]

        ok = await weather({"city": "Paris"}, ctx(tmp_path))
        assert not ok.is_error
        assert ok.output == canned_result("weather", "get_weather", {"city": "Paris"})

        # The server validates too: its error comes back as an error result, not a raise.
        bad = await weather({"town": "Paris"}, ctx(tmp_path))
        assert bad.is_error
        assert "'city' is a required property" in bad.output

        registry = ToolRegistry()
        ToolCatalog(mcp.tools()).register_into(registry)
        context = ctx(tmp_path)
        result = await registry.call("weather__get_weather", '{"city": "Oslo"}', context)
        assert result.output.endswith('{"city":"Oslo"}')
        # Checked against the full schema before the server is asked.
        refused = await registry.call("weather__get_weather", '{"city": 3}', context)
        assert refused.is_error and "full schema" in refused.output
        assert [r.name for r in context.transcript] == ["weather__get_weather"] * 2

    late = await echo({"text": "late"}, ctx(tmp_path))
    assert late.is_error and "not connected" in late.output


async def test_streamable_http_serves_every_server_in_any_order(catalog_file, tmp_path):
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", SERVER_MODULE, "--catalog", str(catalog_file), "--http", "0",
        "--delay-ms", "1500", stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        line = (await asyncio.wait_for(process.stdout.readline(), 30)).decode()
        url = line.split()[1]
        echo_srv = McpServerConfig("echo srv", url=f"{url}/echo srv/mcp")
        weather = McpServerConfig("weather", url=f"{url}/weather/mcp")
        async with McpConnections([weather, echo_srv]) as first:
            specs_ab = first.specs()
        async with McpConnections([echo_srv, weather]) as mcp:
            # Registration order does not leak: the same specs, the same bytes.
            assert mcp.specs() == specs_ab
            assert [s.display_name for s in specs_ab] == ["echo-srv.echo", "weather.get_weather"]
            echo = mcp.tools()[0]
            started = time.perf_counter()
            # Two calls at once take one delay, not two: the server serves them together.
            results = await asyncio.gather(
                echo({"text": "a"}, ctx(tmp_path)), echo({"text": "b"}, ctx(tmp_path))
            )
            elapsed = time.perf_counter() - started
        assert [r.output for r in results] == [
            canned_result("echo srv", "echo", {"text": "a"}),
            canned_result("echo srv", "echo", {"text": "b"}),
        ]
        assert 1.5 <= elapsed < 2.9  # one after the other would be >= 3.0
    finally:
        process.terminate()
        await process.wait()


async def test_a_server_that_does_not_start_is_a_connection_error(tmp_path):
    broken = McpServerConfig("broken", command=sys.executable, args=("-c", "pass"))
    with pytest.raises(ConnectionError, match="broken"):
        async with McpConnections([broken], connect_timeout_s=10):
            pass


def test_server_configs_are_checked():
    with pytest.raises(ValueError, match="exactly one"):
        McpServerConfig("x")
    with pytest.raises(ValueError, match="exactly one"):
        McpServerConfig("x", command="a", url="http://b")
    twins = [McpServerConfig("a b", url="http://x"), McpServerConfig("a-b", url="http://y")]
    with pytest.raises(ValueError, match="share the namespace"):
        McpConnections(twins)
    with pytest.raises(ValueError):
        namespace_for("!!!")


def test_namespaces_are_function_name_safe():
    assert namespace_for("Ant Design Components") == "Ant-Design-Components"
    assert namespace_for("a__b") == "a_b"  # "__" separates namespace and tool name
    assert namespace_for("八字 mcp") == "mcp"


def test_load_catalog_reads_every_layout(tmp_path, catalog_file):
    assert sorted(load_catalog(catalog_file)) == ["echo srv", "weather"]
    assert load_catalog(catalog_file, "weather") == {"weather": [WEATHER]}
    with pytest.raises(ValueError, match="no server 'nope'"):
        load_catalog(catalog_file, "nope")
    snaps = tmp_path / "snaps"
    snaps.mkdir()
    (snaps / "b.snap").write_text(json.dumps(ECHO))
    (snaps / "a.snap").write_text(json.dumps(WEATHER))
    assert load_catalog(snaps, "gh") == {"gh": [WEATHER, ECHO]}
    mapping = tmp_path / "map.json"
    mapping.write_text(json.dumps({"s": [ECHO]}))
    assert load_catalog(mapping) == {"s": [ECHO]}
    mapping.write_text(json.dumps({"s": "not a list"}))
    with pytest.raises(ValueError, match="not a catalog"):
        load_catalog(mapping)


def test_catalog_server_cli_refuses_ambiguous_stdio(catalog_file, capsys):
    from once.agent.tools.catalog_server import main

    assert main(["--catalog", str(catalog_file)]) == 2
    assert "pass --server" in capsys.readouterr().err
    assert main(["--catalog", str(catalog_file), "--list-servers"]) == 0
    assert capsys.readouterr().out.split("\n")[:2] == ["echo srv", "weather"]
    assert main(["--catalog", "/nonexistent.json"]) == 2
