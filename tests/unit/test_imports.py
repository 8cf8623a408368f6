"""scape_ds's modules import each other in one direction: the import graph has no cycle.

Every ``.py`` file under ``scape_ds/`` is parsed (not imported) and every ``import`` of a scape_ds
module, relative or absolute, at module level or inside a function, is an edge. ``from . import x``
and ``from .pkg import name`` count as an edge to the submodule ``x`` / ``pkg.name`` when that is a
module, else to the package. A package's ``__init__`` is a module of its own: importing
``scape_ds.a.b`` runs ``scape_ds.a``'s ``__init__`` too, but an edge to a package's ``__init__`` that
only re-exports its submodules would make every such package a cycle with its submodules, so the
edge is the one the code names.
"""
from __future__ import annotations

import ast
import os

PACKAGE = "scape_ds"
ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), PACKAGE)


def module_files(root: str = ROOT, package: str = PACKAGE) -> dict[str, str]:
    """Dotted module name -> file path, for every .py file under ``root`` (``pkg.__init__`` is ``pkg``)."""
    found = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        rel = os.path.relpath(folder, root)
        prefix = package if rel == "." else package + "." + rel.replace(os.sep, ".")
        for name in sorted(files):
            if name.endswith(".py"):
                found[prefix if name == "__init__.py" else f"{prefix}.{name[:-3]}"] = os.path.join(folder, name)
    return found


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute name ``from <node.module>`` (with ``node.level`` dots) names inside ``module``."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph(files: dict[str, str] | None = None) -> dict[str, set[str]]:
    """Module -> the scape_ds modules it imports anywhere in its file (module level or in functions)."""
    files = module_files() if files is None else files
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        is_package = os.path.basename(path) == "__init__.py"
        edges = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(module, is_package, node)
                # from pkg import sub: the submodule when there is one, else pkg itself
                names = [f"{target}.{a.name}" if f"{target}.{a.name}" in files else target for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in files:  # import scape_ds.a.b.attr -> the longest module prefix
                    name = name.rpartition(".")[0]
                if name.startswith(PACKAGE) and name != module:
                    edges.add(name)
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle ``[a, b, ..., a]`` of ``graph`` (depth-first search), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def cycles(graph: dict[str, set[str]]) -> list[tuple[list[str], list[str]]]:
    """Each group of modules that import each other (a strongly connected component of more than one
    module), sorted, with one cycle through it, ``[a, b, ..., a]``; empty when the graph has none."""
    reach = {m: _reachable(graph, m) for m in graph}
    groups, seen = [], set()
    for m in sorted(graph):
        if m in seen or m not in reach[m]:
            continue
        group = {n for n in reach[m] if m in reach[n]}
        seen |= group
        groups.append((sorted(group), find_cycle({n: graph[n] & group for n in group})))
    return groups


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """The modules reached from ``start`` by one or more edges."""
    found, todo = set(), list(graph.get(start, ()))
    while todo:
        node = todo.pop()
        if node not in found:
            found.add(node)
            todo.extend(graph.get(node, ()))
    return found


def test_the_walker_sees_relative_absolute_and_function_level_imports(tmp_path):
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("import scape_ds.c\nfrom .. import c\n")
    (pkg / "c.py").write_text("def g():\n    from scape_ds.a import f\n")
    graph = import_graph(module_files(str(pkg)))
    assert graph == {"scape_ds": {"scape_ds.a"}, "scape_ds.a": {"scape_ds.sub.b"}, "scape_ds.sub": set(),
                     "scape_ds.sub.b": {"scape_ds.c"}, "scape_ds.c": {"scape_ds.a"}}
    assert find_cycle(graph) == ["scape_ds.a", "scape_ds.sub.b", "scape_ds.c", "scape_ds.a"]
    assert cycles(graph) == [(["scape_ds.a", "scape_ds.c", "scape_ds.sub.b"],
                              ["scape_ds.a", "scape_ds.sub.b", "scape_ds.c", "scape_ds.a"])]
    assert cycles({"x": {"y"}, "y": set()}) == []


def test_scape_ds_has_no_import_cycle():
    graph = import_graph()
    assert "scape_ds.engine" in graph and graph["scape_ds.engine"], "the walker found no imports"
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(
        f"{', '.join(group)} import each other, e.g. {' -> '.join(cycle)}" for group, cycle in found)
