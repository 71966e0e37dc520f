import ast
from pathlib import Path

from once.tool_search import ToolIndex, merge_namespaces, response_tool_entries


def function(name, description, deferred=True, **properties):
    tool = {
        "type": "function",
        "name": name,
        "description": description,
        "parameters": {"type": "object", "properties": {k: {"type": "string"} for k in properties}},
    }
    return {**tool, "defer_loading": True} if deferred else tool


TOOLS = [
    function("get_weather", "Current weather and forecast for a city.", city="string"),
    function("shell", "Run a command.", deferred=False, command="string"),
    {
        "type": "namespace",
        "name": "crm",
        "description": "CRM tools for customer lookup and order management.",
        "tools": [
            function("list_open_orders", "List open orders for a customer ID.", customer_id=1),
            function("get_customer", "Look up a customer by email.", email=1),
            function("whoami", "The signed-in agent.", deferred=False),
        ],
    },
    {
        "type": "namespace",
        "name": "billing",
        "description": "Invoices.",
        "tools": [function("list_open_orders", "Orders awaiting an invoice.", customer_id=1)],
    },
    {"type": "tool_search"},
    {"type": "web_search"},
]


def names(tools):
    return [
        f"{tool['name']}.{tool['tools'][0]['name']}"
        if tool["type"] == "namespace"
        else tool["name"]
        for tool in tools
    ]


def test_only_deferred_functions_are_searchable_unless_asked():
    deferred = [doc.qualified_names()[0] for doc, _ in response_tool_entries(TOOLS)]
    assert deferred == [
        "get_weather",
        "crm.list_open_orders",
        "crm.get_customer",
        "billing.list_open_orders",
    ]
    every = [doc.name for doc, _ in response_tool_entries(TOOLS, deferred_only=False)]
    assert every == [
        "get_weather",
        "shell",
        "list_open_orders",
        "get_customer",
        "whoami",
        "list_open_orders",
    ]


def test_answers_are_the_tools_to_load_a_function_inside_its_namespace():
    index = ToolIndex.from_response_tools(TOOLS)
    (weather,) = index.search("weather in Paris tomorrow", 1)
    assert weather == TOOLS[0]
    (orders,) = index.search("crm.list_open_orders", 1)
    assert orders == {
        "type": "namespace",
        "name": "crm",
        "description": "CRM tools for customer lookup and order management.",
        "tools": [TOOLS[2]["tools"][0]],
    }
    assert names(index.search("crm__get_customer", 1)) == ["crm.get_customer"]
    assert index.search("run a command", 5) == []  # shell is loaded already: not searchable


def test_a_bare_name_in_two_namespaces_finds_both_and_select_is_exact():
    index = ToolIndex.from_response_tools(TOOLS)
    assert set(names(index.search("list_open_orders", 2))) == {
        "crm.list_open_orders",
        "billing.list_open_orders",
    }
    selection = index.select("billing.list_open_orders, crm.nope")
    assert names(selection.tools) == ["billing.list_open_orders"]
    assert selection.unknown == ["crm.nope"]
    # The namespace's name is searchable text: "crm" decides between the two.
    assert names(index.search("open orders in the crm", 1)) == ["crm.list_open_orders"]
    assert names(index.search("open orders for billing", 1)) == ["billing.list_open_orders"]


def test_merge_namespaces_groups_matches_where_the_namespace_first_ranked():
    index = ToolIndex.from_response_tools(TOOLS)
    found = index.search("select:crm.get_customer,get_weather,crm.list_open_orders", 5)
    merged = merge_namespaces(found)
    assert [t["name"] for t in merged] == ["crm", "get_weather"]
    assert [f["name"] for f in merged[0]["tools"]] == ["get_customer", "list_open_orders"]
    assert [f["name"] for f in found[0]["tools"]] == ["get_customer"]  # inputs untouched


def test_the_package_imports_no_layer_that_uses_it():
    package = Path(__file__).resolve().parents[2] / "src" / "once" / "tool_search"
    imported = set()
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
            elif isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
    once_modules = {m for m in imported if m.split(".")[0] == "once"}
    assert once_modules and all(
        m.startswith(("once.tool_search", "once.protocol")) for m in once_modules
    )
    assert not {m.split(".")[0] for m in imported} & {"torch", "transformers"}
