"""No import cycle among hcache's modules, the imports under TYPE_CHECKING included: the
layers of pyproject's import-linter contracts say which packages may import which; this
says that no module reaches itself again, inside a layer too."""

from __future__ import annotations

import grimp


def cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for m in sorted(graph.modules):
        if m not in index:
            visit(m)
    return out


def test_no_module_imports_itself_back():
    graph = grimp.build_graph("hcache", exclude_type_checking_imports=False)
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_planted_cycle():
    graph = grimp.ImportGraph()
    for m in ("pkg", "pkg.a", "pkg.b", "pkg.c"):
        graph.add_module(m)
    graph.add_import(importer="pkg.a", imported="pkg.b")
    graph.add_import(importer="pkg.b", imported="pkg.c")
    graph.add_import(importer="pkg.c", imported="pkg.a")
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
