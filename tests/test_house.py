"""The house rules a next engineer can rely on: ``oink`` works without the plugin's stack (the tuner gates and
times with ``oink.measure``, which ``pytest_oink`` imports, never the other way round), and no module of
``oink`` or ``pytest_oink`` takes part in an import cycle, counting the imports inside functions, or is over
``MAX_LINES`` lines. CPU only."""
from __future__ import annotations

import ast
import importlib.util
import subprocess
from pathlib import Path

from tests.fresh import python_without

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("oink", "pytest_oink")
PLUGIN_STACK = ("pytest", "_pytest", "pytest_oink", "hypothesis", "pytest_benchmark")

def _python(code: str) -> subprocess.CompletedProcess:
    return python_without(PLUGIN_STACK, code, ROOT)


def test_the_tuner_imports_without_the_plugin_stack():
    out = _python("import oink.tune\nimport oink.measure.gate, oink.measure.timer\nprint(oink.tune.__file__)")
    assert out.returncode == 0, out.stderr[-3000:]
    assert Path(out.stdout.strip()).resolve() == ROOT / "oink" / "tune.py"


def test_the_tuner_runs_without_the_plugin_stack():
    out = _python("import runpy\nsys.argv = ['oink.tune', '--help']\n"
                  "runpy.run_module('oink.tune', run_name='__main__')")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "usage:" in out.stdout and "--widths" in out.stdout


def _modules() -> dict:
    """{dotted name: (path, is a package)} of every module of ``PACKAGES``."""
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def _imports(name: str, path: Path, is_package: bool, known) -> dict:
    """{module imported: the first line importing it} of one module: every ``import`` and ``from ... import``
    anywhere in it (inside functions too), relative ones resolved; ``from pkg import name`` where ``pkg.name``
    is a module imports that module (else ``pkg``); ``importlib.import_module`` of a literal name counts too.
    Only modules in ``known`` are kept. A package imported on the way to its submodule is not counted."""
    package = name if is_package else name.rpartition(".")[0]
    out: dict = {}

    def add(target: str, line: int) -> None:
        while target and target not in known:  # ``import a.b.c`` of a name in module a.b
            target = target.rpartition(".")[0]
        if target and target != name:
            out.setdefault(target, line)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) if node.level \
                else node.module
            for alias in node.names:
                add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base, node.lineno)
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and (getattr(node.func, "attr", None) or getattr(node.func, "id", None)) == "import_module"):
            target, anchor = node.args[0].value, node.args[1] if len(node.args) > 1 else None
            if target.startswith("."):
                anchor = anchor.value if isinstance(anchor, ast.Constant) else name  # ``__name__``
                target = importlib.util.resolve_name(target, anchor)
            add(target, node.lineno)
    return out


def import_graph() -> dict:
    """{module: {module it imports: line}} over ``PACKAGES``."""
    known = _modules()
    return {name: _imports(name, path, is_package, known) for name, (path, is_package) in known.items()}


def cycles(graph: dict) -> list[list[str]]:
    """One cycle (a list of modules, the first repeated at the end) in each strongly connected component of
    more than one module."""
    return [_cycle_in(graph, component) for component in components(graph)]


def components(graph: dict) -> list[set]:
    """The strongly connected components of more than one module (Tarjan's, iterative): each holds cycles."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(graph[w])))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.add(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def _cycle_in(graph: dict, component: set) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first, within the component)."""
    start = min(component)
    parents, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    path = [v]
                    while parents[path[-1]] is not None:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w in component and w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")


def test_the_cycle_finder_names_a_cycle():
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 4}, "d": {}, "e": {"e": 5}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b": 1}, "b": {}}) == []


def test_no_import_cycles():
    graph = import_graph()
    assert graph["oink.tune"] and graph["pytest_oink.plugin"]  # the scan sees imports (inside functions too)
    assert "oink.ops" in graph["oink"]  # and import_module of a literal name
    found = components(graph)
    named = []
    for component in found:
        cycle = _cycle_in(graph, component)
        named.append("\n  ".join([f"{a} -> {b} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])]
                                 + [f"(all in one circle: {', '.join(sorted(component))})"]))
    assert not found, "import cycles:\n  " + "\n\n  ".join(named)


def test_oink_imports_nothing_from_pytest_oink():
    graph = import_graph()
    wrong = {m: sorted(t for t in imported if t.partition(".")[0] == "pytest_oink")
             for m, imported in graph.items() if m.partition(".")[0] == "oink"}
    assert not {m: t for m, t in wrong.items() if t} and not _raw_imports_of("pytest_oink")


def _raw_imports_of(top: str) -> list[str]:
    """Modules of ``oink`` that name ``top`` in any import (the graph keeps only modules it knows)."""
    hits = []
    for path in sorted((ROOT / "oink").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            hits += [f"{path.relative_to(ROOT)}:{node.lineno}" for n in names if n.partition(".")[0] == top]
    return hits


MAX_LINES = 600  # a module a reader takes in at one sitting; past it, split it by what its parts are


def test_no_module_is_over_the_line_bar():
    long = {f"{path.relative_to(ROOT)}": n for path, _ in _modules().values()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them): {long}"


def test_the_results_page_is_a_page():
    """bench/RESULTS.md holds one current table per suite and card, not a diary of changes: 300 lines at most."""
    n = len((ROOT / "bench" / "RESULTS.md").read_text().splitlines())
    assert n <= 300, f"bench/RESULTS.md has {n} lines: replace tables, move history to CHANGELOG.md"


def test_gpu_modules_left_out_on_a_cpu_still_import():
    """A CPU session does not collect the modules whose every test needs a GPU (conftest.py); each still imports
    here, which builds its parametrizations, so an error in one shows on a CPU too."""
    import importlib

    gpu_only = importlib.import_module("conftest").gpu_only_modules(ROOT)
    assert any(p.stem == "test_rmsnorm_gpu" for p in gpu_only) and len(gpu_only) >= 10, gpu_only
    for path in gpu_only:
        importlib.import_module(f"tests.{path.stem}")
