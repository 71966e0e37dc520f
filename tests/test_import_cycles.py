"""No two modules of once import each other, directly or around a loop.

The graph counts every `import` and `from ... import`, at module level and inside
functions alike (a lazy import still ties the two modules together), but not those under
`if TYPE_CHECKING:`, which never run. An edge goes to the module named: `from a.b import
c` points at `a.b.c` when that is a module, else at `a.b`. The package an import passes
through (`a` for `a.b`) is not an edge: Python registers a package before its
`__init__` runs, so that is never a cycle.
"""

import ast
from pathlib import Path

import once

SOURCE_ROOT = Path(once.__file__).parent
# Being rewritten on its own branch; that rewrite removes this line.
EXCLUDED_PACKAGES = ("once.gateway",)


def module_names() -> dict[str, Path]:
    names = {}
    for path in SOURCE_ROOT.rglob("*.py"):
        parts = list(path.relative_to(SOURCE_ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def imported_modules(path: Path, module: str, modules: dict[str, Path]) -> set[str]:
    found = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for statement in child.orelse:
                    visit_statement(statement)
            else:
                visit_statement(child)

    def visit_statement(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, path, module)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.add(submodule if submodule in modules else base)
        else:
            visit(node)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return {name for name in found if name in modules and name != module}


def import_graph() -> dict[str, set[str]]:
    modules = module_names()
    return {
        name: {m for m in imported_modules(path, name, modules) if not _excluded(m)}
        for name, path in modules.items()
        if not _excluded(name)
    }


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_check_sees_a_lazy_import_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _absolute(node: ast.ImportFrom, path: Path, module: str) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".")
    if path.name != "__init__.py":
        package.pop()
    package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def _excluded(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in EXCLUDED_PACKAGES)
