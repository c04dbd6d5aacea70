"""eagle2_core's modules import downward only: the graph of their imports has no cycle.

Read from the source with `ast`, so a function-level `from .x import y` (the usual way a cycle
hides: it only fails at the call) counts as much as a module-level one. `from . import x`
depends on x, not on the package's __init__ (which imports the engine for callers)."""
from __future__ import annotations

import ast
import pathlib

import eagle2_core

ROOT = pathlib.Path(eagle2_core.__file__).parent


def module_name(path: pathlib.Path, root: pathlib.Path = ROOT) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    """{module: the package's modules it imports anywhere in its source}."""
    paths = {module_name(p, root): p for p in root.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                subs = [f"{target}.{a.name}" for a in node.names]  # `from .pkg import module`
                names = subs if node.module is None else [target, *subs]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            deps |= {n for n in names if n in paths and n != name}
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_checker_sees_a_cycle(tmp_path):
    """The check can fail: a package whose modules import each other, one of them inside a function."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .a import f\n")
    (pkg / "a.py").write_text("from .b import g\n\ndef f():\n    return g()\n")
    (pkg / "b.py").write_text("def g():\n    from .a import f\n    return f\n")
    (pkg / "c.py").write_text("from . import a\n")
    graph = import_graph(pkg)
    assert graph["pkg.c"] == {"pkg.a"} and graph["pkg.b"] == {"pkg.a"}
    assert cycles(graph) == [["pkg.a", "pkg.b"]]


def test_eagle2_core_has_no_import_cycle():
    graph = import_graph()
    assert {"eagle2_core.engine", "eagle2_core.cycle", "eagle2_core.kvcache", "eagle2_core.measure", "eagle2_core.costs",
            "eagle2_core.train.pipeline"} <= set(graph)
    found = cycles(graph)
    print(f"\n[imports] {len(graph)} modules, {sum(map(len, graph.values()))} imports; cycles: {found}")
    assert found == [], found
    # the layers of the decoding stack, each importing only those below it
    assert "eagle2_core.engine" not in graph["eagle2_core.measure"] | graph["eagle2_core.cycle"] | graph["eagle2_core.costs"]
    assert "eagle2_core.measure" not in graph["eagle2_core.costs"] | graph["eagle2_core.cycle"]
    assert "eagle2_core.cycle" not in graph["eagle2_core.kvcache"] | graph["eagle2_core.costs"]
