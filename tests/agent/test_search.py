import json

import jsonschema
import pytest

from once.agent.tools.base import ToolContext, ToolSpec
from once.agent.tools.catalog import ToolCatalog, spec_index
from once.agent.tools.discovery import (
    TOOL_SEARCH_NAME,
    DeferredTools,
    deferred_prompt_fraction,
    definitions_tokens,
    plan_tools,
)
from once.agent.tools.registry import ToolRegistry
from once.agent.tools.schema import estimate_tokens
from once.protocol.responses import canonical_json, parse_request
from once.tool_search import HashedWordEmbedder


def spec(namespace, name, description, **properties):
    schema = {"type": "object", "properties": {k: {"type": v} for k, v in properties.items()}}
    return ToolSpec(name, description, schema, namespace)


SPECS = [
    spec("alpha", "search", "Look something up.", q="string"),
    spec("beta", "search", "Search the web: search pages, search news, search images.", q="string"),
    spec("gamma", "web_search", "Search the web for pages and news.", query="string"),
    spec("gamma", "getPageContent", "Download a web page by its URL.", url="string"),
    spec("files", "write_file", "Create or overwrite a file with new content.", path="string"),
    spec("clock", "get_current_time", "The current time in a timezone.", timezone="string"),
    spec("trains", "get_tickets", "查询12306余票信息", date="string"),
]
CORE = [spec("", "shell", "Run a command.", command="string"), spec("", "apply_patch", "Patch.")]


def names(specs):
    return [s.display_name for s in specs]


# --- the catalog's search (the ranker itself: tests/tool_search) ----------------------


def test_the_catalog_searches_its_specs_with_the_shared_ranker():
    catalog = ToolCatalog.from_specs(SPECS)
    assert names(catalog.search("alpha__search", 1)) == ["alpha.search"]
    assert names(catalog.search("put the report in /root/out/report.md", 1)) == ["files.write_file"]
    assert catalog.search("timezone", 1) == [SPECS[5]]  # the spec objects themselves
    assert catalog.index() is catalog.index()  # built once
    assert names(catalog.index().select("gamma.web_search").tools) == ["gamma.web_search"]
    assert names(spec_index(SPECS, "plain").search("alpha.search", 1)) != ["alpha.search"]


def test_a_catalog_with_an_embedder_can_rank_hybrid():
    catalog = ToolCatalog.from_specs(SPECS, ranker="hybrid", embedder=HashedWordEmbedder())
    assert catalog.index().ranker == "hybrid"
    assert names(catalog.search("gamma.web_search", 1)) == ["gamma.web_search"]
    assert catalog.index("bm25").ranker == "bm25"


# --- deferred discovery --------------------------------------------------------------


def big_catalog(n=200):
    return ToolCatalog.from_specs(
        spec(f"srv{i % 10}", f"tool_{i}", f"Does thing number {i} with care.", x="string")
        for i in range(n)
    )


def test_below_the_threshold_every_tool_is_inline():
    catalog = ToolCatalog.from_specs(SPECS[:2])
    plan = plan_tools(CORE, catalog.specs(), threshold_tokens=10_000)
    assert not plan.deferred
    assert [t["name"] for t in plan.tools] == [
        "apply_patch",
        "shell",
        "alpha__search",
        "beta__search",
    ]
    assert DeferredTools(CORE, catalog, threshold_tokens=10_000).tools() == []


def test_above_the_threshold_only_core_tools_and_tool_search():
    discovery = DeferredTools(CORE, big_catalog(), threshold_tokens=2_000)
    assert discovery.deferred
    assert [t["name"] for t in discovery.request_tools()] == ["apply_patch", "shell", "tool_search"]
    assert discovery.plan.tokens == definitions_tokens(discovery.request_tools(), estimate_tokens)
    fraction = deferred_prompt_fraction(CORE, big_catalog().specs())
    assert 0 < fraction <= 0.10
    expected = discovery.plan.tokens / discovery.plan.inline_tokens
    assert fraction == pytest.approx(expected)


async def test_tool_search_output_item_is_a_valid_tail_item(tmp_path):
    catalog = ToolCatalog.from_specs(SPECS)
    discovery = DeferredTools(CORE, catalog, threshold_tokens=0, budget_tokens=60)
    registry = ToolRegistry(discovery.tools())
    catalog.register_into(registry)
    ctx = ToolContext(workspace=tmp_path)
    tools_before = canonical_json(discovery.request_tools())

    result = await registry.call(TOOL_SEARCH_NAME, '{"query": "search the web", "limit": 2}', ctx)
    item = discovery.output_item("call_1", result)
    assert item["type"] == "tool_search_output"
    assert item["call_id"] == "call_1"
    assert item["execution"] == "client" and item["status"] == "completed"
    assert [t["name"] for t in item["tools"]] == ["gamma__web_search", "beta__search"]
    for tool in item["tools"]:
        assert estimate_tokens(canonical_json(tool)) <= 60
        jsonschema.Draft202012Validator.check_schema(tool["parameters"])

    call = {"type": "function_call", "call_id": "call_1", "name": TOOL_SEARCH_NAME}
    call["arguments"] = '{"query": "search the web", "limit": 2}'
    body = {
        "model": "m",
        "tools": discovery.request_tools(),
        "input": [{"role": "user", "content": "find news"}, call, item],
    }
    request = parse_request(json.loads(json.dumps(body)))
    assert request.input_items[-1]["tools"] == item["tools"]

    # The same tools again are not re-sent; the model reads why.
    again = discovery.output_item(
        "call_2", await registry.call(TOOL_SEARCH_NAME, call["arguments"], ctx)
    )
    assert again["type"] == "function_call_output"
    assert "already loaded: gamma__web_search, beta__search" in again["output"]
    assert [t["name"] for t in discovery.loaded_tools()] == ["gamma__web_search", "beta__search"]
    assert canonical_json(discovery.request_tools()) == tools_before


async def test_tool_search_failures_are_text_the_model_reads(tmp_path):
    catalog = ToolCatalog.from_specs(SPECS)
    discovery = DeferredTools(CORE, catalog, threshold_tokens=0)
    registry = ToolRegistry(discovery.tools())
    ctx = ToolContext(workspace=tmp_path)
    unknown = await registry.call(TOOL_SEARCH_NAME, {"query": "select:nope"}, ctx)
    assert unknown.is_error and "unknown tools: nope" in unknown.output
    item = discovery.output_item("c", unknown)
    assert item == {"type": "function_call_output", "call_id": "c", "output": unknown.output}
    nothing = await registry.call(TOOL_SEARCH_NAME, {"query": "zzzqqq"}, ctx)
    assert nothing.is_error and "no tool matches" in nothing.output
    bad = await registry.call(TOOL_SEARCH_NAME, {"query": "x", "limit": 0}, ctx)
    assert bad.is_error and "full schema" in bad.output
    partly = await registry.call(TOOL_SEARCH_NAME, {"query": "select:nope,alpha.search"}, ctx)
    assert not partly.is_error and "unknown tools: nope" in partly.output
    assert [t["name"] for t in partly.metadata["tools"]] == ["alpha__search"]


async def test_discovered_tools_are_validated_against_the_full_schema(tmp_path):
    full = ToolSpec(
        "create",
        "Create an item.",
        {
            "type": "object",
            "properties": {
                "kind": {"type": "string", "enum": ["a", "b"], "description": "x" * 400}
            },
            "required": ["kind"],
        },
        "items",
    )
    catalog = ToolCatalog.from_specs([full])
    discovery = DeferredTools(CORE, catalog, threshold_tokens=0, budget_tokens=40)
    registry = ToolRegistry(discovery.tools())
    catalog.register_into(registry)
    ctx = ToolContext(workspace=tmp_path)
    loaded = await registry.call(TOOL_SEARCH_NAME, {"query": "items.create"}, ctx)
    (shown,) = loaded.metadata["tools"]
    assert "description" not in shown["parameters"]["properties"]["kind"]  # compressed
    refused = await registry.call("items__create", {"kind": "c"}, ctx)
    assert refused.is_error and '"description":' in refused.output.replace(" ", "")


# --- the bench on the real catalogs --------------------------------------------------


@pytest.fixture(scope="module")
def data_dir():
    from once.bench.agent_bench.search import default_data_dir

    root = default_data_dir()
    if not (root / "livemcpbench").is_dir():
        pytest.skip(f"no tool_retrieval data at {root} (set ONCE_SHARED_DATA)")
    return root


def test_bench_on_a_slice_discovers_the_catalogs_over_mcp(data_dir):
    from once.bench.agent_bench.search import run

    result = run(data_dir, max_tasks=8, tokenizer="estimate", hybrid=False)
    assert result["discovered_via"] == "mcp-streamable-http"
    assert (result["num_tools"], result["num_servers"], result["num_tasks"]) == (644, 71, 8)
    assert result["exact_name_top1"] == 1.0
    assert result["shared_bare_names"] >= 10 and result["shared_bare_names_first"] == 1.0
    assert result["deferred_prompt_fraction"] <= 0.10
    assert 0 < result["tool_search_recall_at_5"] <= 1
    assert result["num_tasks_tuning"] + result["num_tasks_heldout"] == 8
    assert result["tool_search_default_ranker"] == "bm25"


def test_recall_bar_on_every_task(data_dir):
    from once.bench.agent_bench.search import load_specs, load_tasks, recall_at_k

    specs = load_specs(data_dir)
    tasks = load_tasks(data_dir, {s.name for s in specs if s.namespace != "github"})
    assert len(tasks) == 94
    default = recall_at_k(spec_index(specs), tasks)
    plain = recall_at_k(spec_index(specs, "plain"), tasks)
    assert default >= 0.40
    assert plain < default


def test_catalog_lookup_and_refused_schemas_do_not_stop_registration():
    draft4 = ToolSpec(
        "read_pdf",
        "Read a PDF.",
        {"type": "object", "properties": {"page": {"type": "integer", "exclusiveMinimum": True}}},
        "pdf",
    )
    catalog = ToolCatalog.from_specs([*SPECS, draft4])
    assert catalog.get("alpha.search") is catalog.get("alpha__search") is not None
    assert "pdf.read_pdf" in catalog and "nope.x" not in catalog
    with pytest.raises(ValueError, match="twice"):
        catalog.add(catalog.get("alpha.search"))
    registry = ToolRegistry()
    refused = catalog.register_into(registry)
    assert len(refused) == 1 and refused[0].startswith("pdf.read_pdf: True is not of type")
    assert all(s.function_name in registry for s in SPECS)
    assert catalog.register_into(registry) == refused  # idempotent for the rest
