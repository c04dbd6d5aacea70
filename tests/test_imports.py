"""eagle2_core's modules import downward only: the graph of their imports has no cycle.

Read from the source with `ast`, so a function-level `from .x import y` (the usual way a cycle
hides: it only fails at the call) counts as much as a module-level one. `from . import x`
depends on x, not on the package's __init__ (which imports the engine for callers)."""
from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys

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


# -- what an import pulls in: start-up time is mostly imports (torch and transformers' model code)
def imported(modules: list[str], watched: list[str]) -> list[str]:
    """Which of `watched` are in sys.modules after a fresh interpreter imports `modules`."""
    code = ("import importlib, json, sys\nfor m in sys.argv[2:]: importlib.import_module(m)\n"
            "print(json.dumps([w for w in json.loads(sys.argv[1]) if w in sys.modules]))")
    root = str(ROOT.parent)
    r = subprocess.run([sys.executable, "-c", code, json.dumps(watched), *modules], capture_output=True, text=True, timeout=300,
                       cwd=root, env={**os.environ, "PYTHONPATH": root})
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


HEAVY = ["torch", "numpy", "transformers", "transformers.modeling_utils", "accelerate", "bitsandbytes", "starlette", "uvicorn",
         "gguf", "prompt_toolkit", "llguidance", "matplotlib", "datasets"]
CLI_MODULES = ["eagle2_cli.main", "eagle2_cli.chat_cmd", "eagle2_cli.generate_cmd", "eagle2_cli.compare_cmd", "eagle2_cli.serve_cmd",
               "eagle2_cli.tune_cmd", "eagle2_cli.train_cmd", "eagle2_cli.options", "eagle2_cli.ui"]


def test_the_import_watch_sees_an_import():
    """The check can fail: a module that imports json is seen to."""
    assert imported(["json"], ["json", "smtplib"]) == ["json"]
    assert "torch" in imported(["eagle2_core.rowgemm"], HEAVY)


def test_package_and_cli_imports_are_light():
    """`import eagle2_core` and the CLI's modules (what `eagle2 --help` and shell completion load)
    import none of the heavy libraries: each comes inside the function that needs it."""
    cli = [m for m in CLI_MODULES if (ROOT.parent / (m.replace(".", "/") + ".py")).is_file()]
    assert imported(["eagle2_core", "eagle2_core.prompts"], HEAVY) == []
    assert imported(cli, HEAVY) == []


def test_loading_a_target_imports_no_server_or_optional_library():
    """What every command loads before its first answer (runtime, the engine, GGUF loading) imports
    transformers' model code, but not the server's, bitsandbytes, the structured-output
    library, plotting or datasets: those wait for the command that uses them."""
    got = imported(["eagle2_core.runtime", "eagle2_core.ggufload", "eagle2_core.chat"],
                   ["starlette", "uvicorn", "bitsandbytes", "llguidance", "matplotlib", "datasets", "prompt_toolkit"])
    assert got == []
