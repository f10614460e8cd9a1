"""A function-local import only where it defers a heavy or optional dependency, and it says which: every import
inside a function sits under a `# deferred: X, Y` comment, and importing it at module level would indeed load
X (a heavy or optional third-party module) that the module does not load already. Anything else belongs at
module level (there are no import circles to break: tests/test_layout.py)."""

import ast
import os
import re

from test_layout import _modules

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# seconds to import on a 2-core box (python -X importtime), or not always installed (extras, GPU only)
HEAVY = {"torch", "transformers", "matplotlib", "aiohttp", "numpy", "zmq", "rich", "typer", "prometheus_client",
         "pynvml", "flash_attn", "nixl", "nixl_cu12", "nixl_cu13", "vllm", "triton"}
IMPLIES = {"torch": {"numpy"}, "transformers": {"numpy"}, "matplotlib": {"numpy"}}  # loaded by them anyway
# pdlab.engine's names resolve on first use (PEP 562): importing one loads its module then
LAZY = {"EngineConfig": "config", "SamplingParams": "config", "RequestError": "config", "Engine": "engine",
        "HandoffInfo": "engine", "Reservation": "engine", "StepOutput": "engine", "StepRecord": "engine",
        "TokenOut": "engine", "load_model": "model", "ModelLoadError": "model", "PRESETS": "model"}
# files other work had open when this check landed; their imports are to be sorted out the same way
PENDING = ("pdlab/cli.py", "pdlab/commands/profile.py", "pdlab/api/model.py", "pdlab/timing/", "pdlab/external/")
COMMENT = re.compile(r"#\s*deferred:\s*(.+)")


MODS = _modules()


def _targets(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    out = []
    for a in node.names:
        sub = f"{node.module}.{a.name}"
        if node.module == "pdlab.engine" and a.name in LAZY:
            sub = f"pdlab.engine.{LAZY[a.name]}"
        out.append(sub if sub in MODS else node.module)
    return out


def _walk(tree: ast.AST):
    """(import node, inside a function) for every import, TYPE_CHECKING blocks left out."""
    def visit(n, infn):
        for c in ast.iter_child_nodes(n):
            if isinstance(c, ast.If) and "TYPE_CHECKING" in ast.unparse(c.test):
                continue
            if isinstance(c, (ast.Import, ast.ImportFrom)):
                yield c, infn
            yield from visit(c, infn or isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))
    yield from visit(tree, False)


TREES = {m: ast.parse(open(p).read()) for m, p in MODS.items()}
TOP = {m: [t for n, infn in _walk(tree) if not infn for t in _targets(n)] for m, tree in TREES.items()}
_memo: dict[str, set] = {}


def heavy_of(name: str, stack: tuple = ()) -> set:
    """Heavy third-party modules that importing `name` loads (module-level imports, parents included)."""
    out: set = set()
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        n = ".".join(parts[:i])
        if n not in MODS:
            if parts[0] in HEAVY:
                out.add(parts[0])
            break
        if n not in _memo:
            if n in stack:
                continue
            _memo[n] = set().union(*(heavy_of(t, stack + (n,)) for t in TOP[n])) if TOP[n] else set()
        out |= _memo[n]
    for d in list(out):
        out |= IMPLIES.get(d, set())
    return out


def local_imports() -> list[tuple[str, int, str, set, set]]:
    """(path, line, its comment's names or '', what it would load, what its module loads already)."""
    out = []
    for m, tree in TREES.items():
        path = os.path.relpath(MODS[m], ROOT)
        lines = open(MODS[m]).read().split("\n")
        loaded = heavy_of(m)
        for node, infn in _walk(tree):
            if not infn:
                continue
            i = node.lineno - 1  # the comment: on the line, or above the block of imports (blank lines in it)
            while i >= 0 and not COMMENT.search(lines[i]) and (i == node.lineno - 1 or not lines[i].strip() or
                                                               lines[i].strip().startswith(("import ", "from "))):
                i -= 1
            said = COMMENT.search(lines[i]).group(1) if i >= 0 and COMMENT.search(lines[i]) else ""
            need = set().union(*(heavy_of(t) for t in _targets(node)))
            out.append((path, node.lineno, said, need, loaded))
    return out


def test_every_function_local_import_defers_a_heavy_or_optional_dependency_and_says_which():
    wrong = []
    for path, line, said, need, loaded in local_imports():
        if path.startswith(PENDING):
            continue
        defers = need - loaded
        named = {w.strip().split(" ")[0] for w in said.split(",") if w.strip()}
        if not defers:
            wrong.append(f"{path}:{line}: defers nothing heavy (it loads {sorted(need) or 'nothing heavy'}; the "
                         "module has it already): import it at module level")
        elif not named & defers:
            wrong.append(f"{path}:{line}: say what it defers: `# deferred: {', '.join(sorted(defers))}`")
    assert wrong == [], "\n".join(wrong)


def test_the_check_sees_an_import_that_defers_nothing():
    tree = ast.parse("def f():\n    # deferred: torch\n    import os\n")
    (node, infn), = list(_walk(tree))
    assert infn and heavy_of(_targets(node)[0]) == set()  # os: nothing heavy, so the comment is not enough
    assert heavy_of("pdlab.engine.engine") >= {"torch"}  # and a module that loads torch at import does

