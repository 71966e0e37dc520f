"""Import rules of the engine, the router and the eviction policies, read from the source
with `ast` (every import counts: module level, inside a function, under `TYPE_CHECKING`).

- `once.engine` never imports `once.sim`: the live engine runs the simulator's eviction
  policies from their own home, `once.kv_eviction`, not through the simulator.
- `once.router` reaches an engine only through the protocol: `once.protocol` (the
  `EngineClient` contract and its types) and `once.engine_http` (the engine's HTTP API,
  which imports only the protocol), never `once.engine`.
- `once.kv_eviction` imports nothing else from once (and not torch): the engine and the
  simulator both depend on it.
"""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"


def imported_modules(source: str, package: str) -> set[str]:
    """Every module `source` imports, absolute; `package` resolves relative imports. A
    `from x import y` counts as x and as x.y (y may be a submodule)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def imports_of_layer(layer: str) -> dict[str, set[str]]:
    """Module name -> what it imports, for every module of the package `layer`."""
    root = SRC.joinpath(*layer.split("."))
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        name = ".".join(parts)
        package = name if is_package else name.rpartition(".")[0]
        modules[name] = imported_modules(path.read_text(encoding="utf-8"), package)
    return modules


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def violations(layer: str, forbidden: str, allowed: tuple[str, ...] = ()) -> list[str]:
    return sorted(
        f"{name} imports {module}"
        for name, imported in imports_of_layer(layer).items()
        for module in imported
        if within(module, forbidden) and not any(within(module, ok) for ok in allowed)
    )


def test_the_reader_finds_imports_in_functions_and_relative_ones():
    source = (
        "import once.sim.cluster\n"
        "def f():\n"
        "    from once.engine import core\n"
        "from ..sim import kvcache\n"
    )
    found = imported_modules(source, "once.engine")
    assert {"once.sim.cluster", "once.engine.core", "once.sim.kvcache"} <= found


def test_the_engine_does_not_import_the_simulator():
    assert violations("once.engine", "once.sim") == []


def test_the_router_reaches_engines_only_through_the_protocol():
    assert violations("once.router", "once.engine") == []


def test_the_engines_http_api_imports_only_the_protocol():
    outside = [
        f"{name} imports {module}"
        for name, imported in imports_of_layer("once.engine_http").items()
        for module in imported
        if within(module, "once")
        and not within(module, "once.protocol")
        and not within(module, "once.engine_http")
    ]
    assert outside == []


@pytest.mark.parametrize("forbidden", ["once", "torch"])
def test_the_eviction_policies_stand_alone(forbidden):
    allowed = ("once.kv_eviction",) if forbidden == "once" else ()
    assert violations("once.kv_eviction", forbidden, allowed) == []
