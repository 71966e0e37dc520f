import json
import os
import random
import subprocess
import sys
import textwrap

import pytest

from once.agent.prefix import (
    build_request,
    canonical_tools,
    check_instructions,
    common_prefix_len,
    find_volatile,
    fingerprint,
    serialize_request,
)
from once.agent.tools.base import ToolSpec


def spec(name: str, namespace: str = "", **properties) -> ToolSpec:
    schema = {"type": "object", "properties": properties or {"x": {"type": "string"}}}
    return ToolSpec(name=name, description=f"{name} tool", parameters=schema, namespace=namespace)


# --- canonical tools ---


def test_tools_sorted_by_namespace_then_name_whatever_the_input_order():
    tools = [spec("b", "zeta"), spec("shell"), spec("a", "zeta"), spec("z", "alpha")]
    names = [t["name"] for t in canonical_tools(tools)]
    # built-ins (no namespace) first, then namespaces in order, names in order within each
    assert names == ["shell", "alpha__z", "zeta__a", "zeta__b"]
    assert canonical_tools(reversed(tools)) == canonical_tools(tools)


def test_dict_tools_sort_like_specs_by_their_namespaced_name():
    as_dicts = [spec("b", "zeta").to_function_tool(), spec("shell").to_function_tool()]
    as_dicts.append(spec("a", "zeta").to_function_tool())
    assert [t["name"] for t in canonical_tools(as_dicts)] == ["shell", "zeta__a", "zeta__b"]


def test_every_object_in_a_tool_has_its_keys_sorted():
    unsorted = {"type": "object", "required": ["b"], "properties": {"b": {}, "a": {"type": "x"}}}
    tool = canonical_tools([ToolSpec("t", "d", unsorted)])[0]
    # plain json.dumps (insertion order) already gives the canonical text
    assert json.dumps(tool) == json.dumps(tool, sort_keys=True)
    assert list(tool["parameters"]["properties"]) == ["a", "b"]


def test_canonical_tools_are_copies_a_later_edit_cannot_reach():
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    tools = canonical_tools([ToolSpec("t", "d", schema)])
    schema["properties"]["b"] = {"type": "integer"}
    assert list(tools[0]["parameters"]["properties"]) == ["a"]


def test_duplicate_and_malformed_tools_are_refused():
    with pytest.raises(ValueError, match="given twice"):
        canonical_tools([spec("shell"), spec("shell")])
    with pytest.raises(ValueError, match="ToolSpec or a dict"):
        canonical_tools(["shell"])


# --- serializer ---


def test_serialize_request_is_sorted_compact_and_keeps_utf8():
    body = {"model": "m", "input": [{"role": "user", "content": "héllo ✓"}], "instructions": "i"}
    text = serialize_request(body)
    assert text == (
        '{"input":[{"content":"héllo ✓","role":"user"}],"instructions":"i","model":"m"}'
    )
    assert serialize_request(dict(reversed(list(body.items())))) == text


def test_serialize_request_refuses_a_non_dict():
    with pytest.raises(ValueError):
        serialize_request([{"model": "m"}])


# --- instructions ---


@pytest.mark.parametrize(
    "volatile, kind",
    [
        ("Session started 2026-11-05T10:42:17Z.", "iso_date"),
        ("Date: 2026/11/05", "iso_date"),
        ("Date: 11/05/2026", "numeric_date"),
        ("As of Nov 5, 2026 the repo is frozen.", "written_date"),
        ("Started at 10:42:17.", "time_of_day"),
        ("Meeting at 9:30 pm.", "time_of_day"),
        ("Today is Thursday.", "current_date_phrase"),
        ("The current date is unknown to you.", "current_date_phrase"),
        ("run id 1762339337", "unix_time"),
        ("session 3f2504e0-4f89-11d3-9a0c-0305e82c3301", "uuid"),
        ("continue resp_68af3c9d2b1e4f0a9c", "api_id"),
        ("answer call_AbC123xyz9 first", "api_id"),
        ("token 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08", "hex_token"),
        ("work in /tmp/tmpa1b2c3d4", "temp_path"),
        ("you run as pid 48213", "process_id"),
    ],
)
def test_instructions_with_a_per_run_value_are_refused(volatile, kind):
    with pytest.raises(ValueError, match=kind):
        check_instructions("You are a coding agent. " + volatile)
    assert find_volatile(volatile)[0][0] == kind


def test_stable_instructions_pass_unchanged():
    text = (
        "You are a coding agent on Python 3.12. Use call_function and file_operations; "
        "answer in HTTP/1.1 terms; a port such as 8080 is fine; wait 2 minutes at most; "
        "commit messages follow RFC 2119. Mark drafts as May be incomplete."
    )
    assert check_instructions(text) is text
    assert find_volatile(text) == []


def test_check_instructions_refuses_a_non_string():
    with pytest.raises(ValueError, match="str"):
        check_instructions(None)


def test_build_request_checks_instructions_and_sorts_tools():
    request = build_request(
        model="m",
        instructions="Be brief.",
        tools=[spec("b"), spec("a")],
        input_items=[{"type": "message", "role": "user", "content": "hi"}],
        temperature=0,
    )
    assert [t["name"] for t in request["tools"]] == ["a", "b"]
    assert request["temperature"] == 0
    with pytest.raises(ValueError, match="iso_date"):
        build_request(model="m", instructions="Now: 2026-01-01", tools=[], input_items=[])


# --- fingerprints ---


def test_fingerprint_parts_come_in_prompt_order_and_chain():
    body = build_request(
        model="m",
        instructions="Be brief.",
        tools=[spec("b"), spec("a")],
        input_items=[{"type": "message", "role": "user", "content": "hi"}],
    )
    fp = fingerprint(body)
    assert [p.name for p in fp.parts] == [
        "params",
        "instructions",
        "tools[0]",
        "tools[1]",
        "input[0]",
    ]
    same = fingerprint(json.loads(json.dumps(body)))
    assert same.digest == fp.digest
    edited = fingerprint({**body, "input": [{"type": "message", "role": "user", "content": "yo"}]})
    assert edited.chain()[:4] == fp.chain()[:4] and edited.chain()[4] != fp.chain()[4]
    output = [{"type": "message", "role": "assistant", "content": "ok"}]
    assert [p.name for p in fp.with_output(output).continued][-2:] == ["input[0]", "input[1]"]
    with pytest.raises(ValueError):
        fingerprint({"model": "m", "input": "hi"})


@pytest.mark.parametrize(
    "a, b, n", [(b"", b"abc", 0), (b"abc", b"abc", 3), (b"abcd", b"abXd", 2), (b"ab", b"abc", 2)]
)
def test_common_prefix_len(a, b, n):
    assert common_prefix_len(a, b) == n


def test_common_prefix_len_matches_a_character_loop():
    def naive(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    rng = random.Random(0)
    for _ in range(300):
        a = "".join(rng.choice("ab") for _ in range(rng.randrange(0, 40)))
        b = a[: rng.randrange(0, len(a) + 1)] + "".join(
            rng.choice("ab") for _ in range(rng.randrange(0, 10))
        )
        assert common_prefix_len(a, b) == naive(a, b)


# --- two processes, two hash seeds, two registration orders: one prefix ---

_FIRST_REQUEST = textwrap.dedent(
    """
    import json, sys
    from once.agent.prefix import build_request, serialize_request
    from once.agent.tools.base import ToolResult, ToolSpec
    from once.agent.tools.registry import ToolRegistry

    class FakeTool:
        def __init__(self, spec):
            self.spec = spec
        async def __call__(self, args, ctx):
            return ToolResult("ok")

    def server(namespace, names):
        # Properties come from a set: their order follows PYTHONHASHSEED.
        props = {"path", "query", "limit", "branch", "owner", "recursive", "encoding"}
        return [
            ToolSpec(name, f"{namespace} {name}", {"type": "object", "properties": {
                p: {"type": "string", "description": p} for p in props}}, namespace)
            for name in names
        ]

    servers = {"github": server("github", ["search_code", "create_issue", "get_file"]),
               "fs": server("fs", ["write_file", "list_dir", "read_file"])}
    registration = sys.argv[1].split(",")
    registry = ToolRegistry()
    registered = []
    for namespace in registration:
        for tool_spec in servers[namespace]:
            registry.register(FakeTool(tool_spec))
            registered.append(tool_spec)
    request = build_request(
        model="smollm2-135m-instruct",
        instructions="You are a coding agent. Use the tools.",
        tools=registered,  # registration order: canonical_tools must do the sorting
        input_items=[{"type": "message", "role": "user", "content": "fix the bug"}],
    )
    naive = json.dumps([s.to_function_tool() for s in registered])
    print(serialize_request(request))
    print(naive)
    """
)


def _first_request(seed: str, order: str) -> tuple[str, str]:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    result = subprocess.run(
        [sys.executable, "-c", _FIRST_REQUEST, order],
        env=env,
        capture_output=True,
        check=True,
        timeout=60,
    )
    canonical, naive = result.stdout.decode().splitlines()
    return canonical, naive


def test_two_processes_with_different_hash_seeds_send_byte_identical_prefixes():
    canonical_a, naive_a = _first_request("1", "github,fs")
    canonical_b, naive_b = _first_request("2", "fs,github")
    assert canonical_a.encode() == canonical_b.encode()
    assert naive_a != naive_b  # without the canonical serializer the bytes would differ
    names = [t["name"] for t in json.loads(canonical_a)["tools"]]
    assert names == sorted(names) and names[0] == "fs__list_dir"
