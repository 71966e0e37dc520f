"""The API's server-side tool search over LiveMCPBench ranks as the harness does."""

import pytest

from once.bench.agent_bench.search import default_data_dir
from once.bench.clients import api_tool_search
from once.gateway.testing import DEFAULT_MODEL, load_runtime


@pytest.fixture(scope="module")
def runtime():
    return load_runtime(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def data_dir():
    root = default_data_dir()
    if not (root / "livemcpbench").is_dir():
        pytest.skip(f"no tool_retrieval data at {root} (set ONCE_SHARED_DATA)")
    return root


async def test_the_tools_the_gateway_loads_are_the_harness_rankers_top_5(runtime, data_dir):
    result = await api_tool_search.run(runtime, max_tasks=12)
    assert result["api_tool_search_tasks"] == 12
    assert result["api_tool_search_equals_harness"]
    assert 0 < result["api_tool_search_recall_at_5"] <= 1


def test_the_catalog_goes_out_as_deferred_namespaces_and_a_server_search(data_dir):
    from once.bench.agent_bench.search import load_specs

    tools = api_tool_search.catalog_tools(load_specs(data_dir))
    namespaces = [t for t in tools if t["type"] == "namespace"]
    assert len(namespaces) == 71 and tools[-1] == {"type": "tool_search", "execution": "server"}
    assert all(f["defer_loading"] for ns in namespaces for f in ns["tools"])
    assert sum(len(ns["tools"]) for ns in namespaces) == 644
