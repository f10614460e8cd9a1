"""The code's shape, checked: no import circles among pdlab's modules (imports inside functions counted), no
library module importing a command, and the report layer reading the recipe as typed objects rather than
plain dicts with defaults of its own."""

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "pdlab")


def _modules() -> dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                mod = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[mod[: -len(".__init__")] if mod.endswith(".__init__") else mod] = path
    return out


def _imports(mods: dict[str, str]) -> dict[str, set[str]]:
    """module -> the pdlab modules it imports, anywhere in it (module level or inside a function)."""
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        with open(path) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pdlab"):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    edges[m].add(sub if sub in mods else node.module)
            elif isinstance(node, ast.Import):
                edges[m].update(a.name for a in node.names if a.name in mods)
    return {m: {t for t in ts if t in mods and t != m} for m, ts in edges.items()}


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles_counting_imports_inside_functions():
    assert _cycles(_imports(_modules())) == []


def test_the_checker_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_libraries_never_import_commands():
    edges = _imports(_modules())
    bad = [(m, t) for m, ts in edges.items() for t in ts
           if t.startswith("pdlab.commands") and not m.startswith("pdlab.commands") and m != "pdlab.cli"]
    assert bad == []


def test_the_report_layer_reads_typed_objects():
    """issue 18: `grep -c '\\.get("' pdlab/report/*.py` <= 10 in all (it was 139)."""
    report = os.path.join(PKG, "report")
    n = 0
    for f in os.listdir(report):
        if f.endswith(".py"):
            with open(os.path.join(report, f)) as fh:
                n += len(re.findall(r'\.get\("', fh.read()))
    assert n <= 10, n
