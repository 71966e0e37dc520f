import copy
import json

import jsonschema
import pytest

from once.agent.tools.schema import (
    compress_schema,
    estimate_tokens,
    map_subschemas,
    schema_tokens,
)

ADDRESS = {
    "type": "object",
    "title": "Address",
    "description": "A postal address. It is used for deliveries and for invoices alike.",
    "properties": {
        "street": {"type": "string", "description": "Street and number.", "maxLength": 200},
        "country": {
            "type": "object",
            "description": "The country.",
            "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}$"}},
        },
    },
    "required": ["street"],
}
ORDER = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "title": "Order",
    "description": "Places an order. Orders are final once placed; check the cart first.",
    "properties": {
        # Property names that look like keywords are data and must survive.
        "title": {"type": "string", "description": "What the order is called, for humans."},
        "description": {"type": "string", "description": "Free text shown on the invoice."},
        "priority": {
            "type": "string",
            "enum": ["low", "normal", "high"],
            "description": "How fast to ship. High costs more and ships the same day.",
        },
        "quantity": {"type": "integer", "minimum": 1, "maximum": 99, "default": 1},
        "ship_to": {"$ref": "#/$defs/address"},
        "note": {
            "anyOf": [{"type": "string"}, {"type": "null"}],
            "description": "Optional note for the courier, printed on the label.",
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "description": "Stock keeping unit."},
                    "options": {"type": "object", "properties": {"gift": {"type": "boolean"}}},
                },
                "required": ["sku"],
            },
        },
        "country": {"type": "string", "enum": [f"C{i}" for i in range(30)]},
    },
    "required": ["title", "items"],
    "$defs": {"address": ADDRESS},
}
VALID_ORDERS = [
    {"title": "t", "items": [{"sku": "a"}]},
    {
        "title": "t",
        "description": "d",
        "priority": "high",
        "quantity": 3,
        "note": None,
        "ship_to": {"street": "Main 1", "country": {"code": "FR"}},
        "items": [{"sku": "a", "options": {"gift": True}}],
        "country": "C7",
    },
]


def props(schema):
    return schema["properties"]


@pytest.mark.parametrize("budget", [10_000, 300, 200, 150, 120, 90, 60, 40, 1])
def test_every_budget_gives_a_valid_looser_schema(budget):
    compressed = compress_schema(ORDER, budget)
    jsonschema.Draft202012Validator.check_schema(compressed)
    for order in VALID_ORDERS:  # whatever the full schema accepts, the compressed one does
        jsonschema.validate(order, compressed)
    assert set(props(compressed)) >= {"title", "items"}  # required properties always stay
    assert compressed["required"] == ["title", "items"]
    if budget >= 40:
        assert schema_tokens(compressed) <= budget


def test_within_budget_is_unchanged_and_the_input_is_never_modified():
    before = copy.deepcopy(ORDER)
    assert compress_schema(ORDER, 10_000) == ORDER
    compress_schema(ORDER, 1)
    assert ORDER == before


def test_descriptions_go_before_enums_and_bounds():
    full = schema_tokens(ORDER)
    compressed = compress_schema(ORDER, int(full * 0.7))
    assert "description" not in props(compressed)["priority"]
    assert props(compressed)["priority"]["enum"] == ["low", "normal", "high"]
    assert props(compressed)["quantity"]["maximum"] == 99
    assert "title" in props(compressed) and "description" in props(compressed)  # properties


def test_first_stages_keep_the_first_sentence():
    stripped = compress_schema(ORDER, 340)
    assert "title" not in stripped and "$schema" not in stripped  # 2020-12 is the default
    assert stripped["description"] == "Places an order."
    assert stripped["$defs"]["address"]["description"] == "A postal address."


def test_defs_deep_objects_and_unions_are_pruned_in_turn():
    small = compress_schema(ORDER, 140)
    assert "$defs" not in small and "$ref" not in props(small)["ship_to"]
    assert props(small)["note"] == {"type": ["null", "string"]}  # a union of plain types
    item = props(small)["items"]["items"]
    assert item.get("properties", {}).get("options", {}) in ({"type": "object"}, {})


def test_long_enums_go_before_short_ones():
    tiny = compress_schema(ORDER, 100)
    assert "enum" not in props(tiny)["country"]
    assert props(tiny)["priority"]["enum"] == ["low", "normal", "high"]


def test_the_last_resort_keeps_required_properties_only():
    smallest = compress_schema(ORDER, 1)
    assert set(props(smallest)) == {"title", "items"}
    assert props(smallest)["items"] == {"type": "array"}


def test_other_shapes_stay_valid():
    draft7 = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "type": "object",
        "properties": {
            "pair": {"type": "array", "items": [{"type": "string"}, {"type": "number"}]},
            "anything": True,
            "one": {"oneOf": [{"type": "string", "description": "a"}, {"type": "integer"}]},
            "both": {"allOf": [{"type": "string"}, {"minLength": 2}]},
        },
        "definitions": {"x": {"type": "string"}},
    }
    for budget in (60, 30, 1):
        compressed = compress_schema(draft7, budget)
        assert compressed["$schema"] == draft7["$schema"]  # tuple `items` reads as draft-07
        jsonschema.Draft7Validator.check_schema(compressed)
        jsonschema.validate({"pair": ["a", 1], "anything": 3, "one": 5, "both": "xy"}, compressed)
    assert compress_schema({}, 0) == {}


def test_map_subschemas_reaches_every_subschema_with_its_depth():
    seen = []
    map_subschemas(ORDER, lambda s, depth: seen.append((s.get("type"), depth)) or s)
    assert ("boolean", 4) in seen  # items -> items -> options -> gift
    assert ("object", 0) in seen


def test_estimate_tokens():
    assert estimate_tokens("") == 0
    assert estimate_tokens("abcd" * 10) == 10
    assert estimate_tokens("查询余票") == 4
    text = json.dumps(ORDER)
    assert estimate_tokens(text) == pytest.approx(len(text) / 4, rel=0.01)


def test_real_catalog_schemas_compress_validly():
    from once.bench.agent_bench.search import default_data_dir, load_specs

    root = default_data_dir()
    if not (root / "livemcpbench").is_dir():
        pytest.skip(f"no tool_retrieval data at {root}")
    specs = load_specs(root)[::2]  # every other one: enough shapes, half the time
    over = 0
    for spec in specs:
        compressed = compress_schema(spec.parameters, 80)
        over += schema_tokens(compressed) > 80
        # Valid under the draft the full schema is valid under (a few are draft-07 only).
        for draft in (jsonschema.Draft202012Validator, jsonschema.Draft7Validator):
            if not list(draft(draft.META_SCHEMA).iter_errors(spec.parameters)):
                draft.check_schema(compressed)
                break
    assert over <= len(specs) // 20  # only schemas with many required properties stay over
