"""scape_ds's modules import each other in one direction: the import graph has no cycle.

Every ``.py`` file under ``scape_ds/`` is parsed (not imported) and every ``import`` of a scape_ds
module, relative or absolute, at module level or inside a function, is an edge. ``from . import x``
and ``from .pkg import name`` count as an edge to the submodule ``x`` / ``pkg.name`` when that is a
module, else to the package. A package's ``__init__`` is a module of its own. Importing
``scape_ds.a.b`` runs ``scape_ds.a``'s ``__init__`` first, so an import at module level (run when the
importer is imported) is also an edge to each package above its target that does not hold the
importer (inside ``scape_ds.a`` that ``__init__`` has already run). An import inside a function runs
when every module is loaded, and is an edge to its target only: otherwise any package whose
``__init__`` re-exports a module that a lower layer's function reaches would count as a cycle.
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
        for node, at_import in _imports(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                target = _resolve(module, is_package, node)
                # from pkg import sub: the submodule when there is one, else pkg itself
                names = [f"{target}.{a.name}" if f"{target}.{a.name}" in files else target for a in node.names]
            for name in names:
                while name and name not in files:  # import scape_ds.a.b.attr -> the longest module prefix
                    name = name.rpartition(".")[0]
                if not name.startswith(PACKAGE):
                    continue
                edges.add(name)
                parts = name.split(".")
                for i in range(1, len(parts)) if at_import else ():  # the packages whose __init__ runs first
                    package = ".".join(parts[:i])
                    if not (module == package or module.startswith(package + ".")):
                        edges.add(package)
        edges.discard(module)
        graph[module] = edges
    return graph


def _imports(tree: ast.AST, at_import: bool = True):
    """Every import statement in ``tree`` with whether it runs when the module is imported (not
    inside a function)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, at_import
        else:
            inner = at_import and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            yield from _imports(node, inner)


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


def test_a_module_level_import_runs_the_packages_init_first(tmp_path):
    """``scape_ds.low`` importing ``scape_ds.pkg.bottom`` at module level runs ``scape_ds.pkg``'s
    ``__init__``, which imports ``scape_ds.pkg.top``, which imports ``scape_ds.low``: a cycle. The same
    import inside a function is not (everything is loaded by then); nor is a sibling's."""
    pkg = tmp_path / PACKAGE
    (pkg / "pkg").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "pkg" / "__init__.py").write_text("from .top import save\n")
    (pkg / "pkg" / "top.py").write_text("from ..low import x\nfrom .bottom import y\n")
    (pkg / "pkg" / "bottom.py").write_text("")
    (pkg / "low.py").write_text("from .pkg.bottom import y\n")
    graph = import_graph(module_files(str(pkg)))
    assert graph["scape_ds.low"] == {"scape_ds.pkg", "scape_ds.pkg.bottom"}
    assert graph["scape_ds.pkg.top"] == {"scape_ds.low", "scape_ds.pkg.bottom"}  # its own package: no edge
    assert cycles(graph)[0][1] == ["scape_ds.low", "scape_ds.pkg", "scape_ds.pkg.top", "scape_ds.low"]
    (pkg / "low.py").write_text("def f():\n    from .pkg.bottom import y\n")
    assert cycles(import_graph(module_files(str(pkg)))) == []


def test_scape_ds_has_no_import_cycle():
    graph = import_graph()
    assert "scape_ds.engine" in graph and graph["scape_ds.engine"], "the walker found no imports"
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(
        f"{', '.join(group)} import each other, e.g. {' -> '.join(cycle)}" for group, cycle in found)
