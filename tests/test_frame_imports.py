"""The engine's modules import one another in one direction: no cycle, at module level or
through an import inside a function (which only hides a cycle until the function runs).

The graph is read from the source (its AST), so the test needs no import order to hold.
"""
import ast
import pathlib

import hetflow.frame

FRAME = pathlib.Path(hetflow.frame.__file__).parent
PACKAGE = "hetflow.frame"


def _targets(node, modules):
    """The frame modules an import statement loads (``__init__`` for the package itself)."""
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        if node.module == PACKAGE:
            return [a.name if a.name in modules else "__init__" for a in node.names]
        if node.module.startswith(PACKAGE + "."):
            return [node.module.split(".")[2]]
        if node.module == "hetflow" and any(a.name == "frame" for a in node.names):
            return ["__init__"]
    if isinstance(node, ast.ImportFrom) and node.level:    # relative: from . import x
        if node.module:
            return [node.module.split(".")[0]]
        return [a.name if a.name in modules else "__init__" for a in node.names]
    if isinstance(node, ast.Import):
        out = []
        for a in node.names:
            if a.name.startswith(PACKAGE + "."):
                out.append(a.name.split(".")[2])
            elif a.name == PACKAGE:
                out.append("__init__")
        return out
    return []


def import_graph(folder=FRAME):
    """``{module: {(imported module, "module" or "function", line)}}`` over the folder."""
    modules = {p.stem for p in folder.glob("*.py")}
    graph = {m: set() for m in modules}
    for m in modules:
        tree = ast.parse((folder / f"{m}.py").read_text())
        top = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            for target in _targets(node, modules):
                if target != m:
                    level = "module" if id(node) in top else "function"
                    graph[m].add((target, level, node.lineno))
    return graph


def cycles(graph, levels=("module", "function")):
    """The strongly connected components of more than one module (each one a cycle)."""
    edges = {m: sorted({t for t, lv, _ in out if lv in levels}) for m, out in graph.items()}
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_frame_modules_import_without_a_cycle():
    graph = import_graph()
    assert len(graph) > 20 and "_table" in graph and "_pycylon" in graph
    assert cycles(graph, levels=("module",)) == []
    found = cycles(graph)
    hidden = [(m, t, line) for m, out in graph.items() for t, lv, line in out
              if lv == "function" and any(m in c and t in c for c in found)]
    assert found == [], f"import cycles {found}; imports inside functions that close them: {hidden}"


def test_the_table_is_data_and_the_adapter_leaves_the_cpu_engine_alone():
    graph = import_graph()
    # the table's module imports no operation; the operations are attached in __init__
    assert {t for t, _, _ in graph["_table"]} <= {"_backend", "_arrays"}
    # pycylon's adapter never calls back into the CPU engine's operations
    cpu_engine = {"_join", "_sort", "_groupby", "_unique", "_shuffle", "_setops", "_localjoin",
                  "_intmatch", "_strmatch", "_localsort", "_aggregate", "_prepare", "__init__"}
    assert not {t for t, _, _ in graph["_pycylon"]} & cpu_engine


def test_cycle_finder_finds_a_cycle_closed_inside_a_function(tmp_path):
    """The check itself: a function-level import that closes a cycle is found."""
    (tmp_path / "_a.py").write_text("from hetflow.frame import _b\n")
    (tmp_path / "_b.py").write_text("def f():\n    from hetflow.frame._a import x\n")
    (tmp_path / "_c.py").write_text("from hetflow.frame import _a\n")
    graph = import_graph(tmp_path)
    assert cycles(graph, levels=("module",)) == []
    assert cycles(graph) == [["_a", "_b"]]


def test_methods_are_the_operations():
    from hetflow import frame

    t = frame.DistributedTable
    assert t.join is frame.join and t.sort is frame.sort and t.gather is frame.gather
    assert t.filter is frame.filter and t.slice is frame.slice
    for name in ("shuffle", "repartition", "groupby", "unique", "head", "tail", "rebalance",
                 "concat", "union", "intersect", "difference", "describe", "select", "drop",
                 "rename", "with_columns", "cast", "fill_null", "to_pandas", "to_polars",
                 "to_parquet"):
        assert callable(getattr(t, name)) and getattr(t, name).__doc__, name
