"""Import rules of the gateway and the harness, read from the source with `ast` (every
import counts: module level, inside a function, under `TYPE_CHECKING`).

- `once.gateway` reaches an engine only through the protocol: `once.protocol` (the
  `EngineClient` contract, its types, and its fake, `protocol/scripted_engine.py`, which
  the gateway's test helpers serve), never `once.engine`, nor the router, the simulator or
  the harness above it.
- `once.agent` (the harness) imports nothing from `once.gateway`: what the two share on the
  wire (the Responses items, the pause hints' metadata key) is in `once.protocol`.
"""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"


def imported_modules(source: str, package: str) -> set[str]:
    """Every module `source` imports, absolute (`package` resolves relative imports); a
    `from x import y` counts as x and as x.y (y may be a submodule)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([module] if module else []))
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def layer_imports(layer: str) -> dict[str, set[str]]:
    """Module name -> what it imports, for every module of the package `layer`."""
    modules = {}
    for path in sorted(SRC.joinpath(*layer.split(".")).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_package else parts)
        package = name if is_package else name.rpartition(".")[0]
        modules[name] = imported_modules(path.read_text(encoding="utf-8"), package)
    return modules


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def violations(layer: str, forbidden: str) -> list[str]:
    return sorted(
        f"{name} imports {module}"
        for name, imported in layer_imports(layer).items()
        for module in imported
        if within(module, forbidden)
    )


def test_the_reader_finds_imports_in_functions_and_relative_ones():
    source = (
        "import once.engine.core\n"
        "def f():\n"
        "    from once.engine import loader\n"
        "from ..engine import scripted\n"
        "from . import pause_hints\n"
    )
    found = imported_modules(source, "once.gateway.hosted")
    assert {"once.engine.core", "once.engine.loader", "once.gateway.engine.scripted"} <= found
    assert "once.gateway.hosted.pause_hints" in found
    assert within("once.engine.core", "once.engine")
    assert not within("once.engine_http.client", "once.engine")


def test_the_gateway_has_rooms():
    modules = layer_imports("once.gateway")
    assert len(modules) > 20
    assert any(name.count(".") > 2 for name in modules)  # once.gateway.<room>.<module>


@pytest.mark.parametrize("forbidden", ["once.engine", "once.router", "once.sim", "once.agent"])
def test_the_gateway_reaches_engines_only_through_the_protocol(forbidden):
    assert violations("once.gateway", forbidden) == []


def test_the_harness_shares_wire_constants_through_the_protocol():
    assert violations("once.agent", "once.gateway") == []
