"""No import circle inside the openk3 package.

Every import statement of every module counts: module level, inside functions (a deferred import
is still a dependency, only a later one) and under ``TYPE_CHECKING``. An edge A -> B is drawn to the
most specific openk3 module named (``from openk3.quant import mx`` -> ``openk3.quant.mx``); a
package's ``__init__`` is its own node. Circles are the strongly connected components of that graph.
"""

from __future__ import annotations

import ast
from pathlib import Path

import openk3

ROOT = Path(openk3.__file__).resolve().parent

# Circles known and tracked, each allowed only as (a subset of) a group listed (none left):
KNOWN: list[set[str]] = []


def modules() -> dict[str, Path]:
    out = {}
    for f in ROOT.rglob("*.py"):
        parts = list(f.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def import_graph() -> dict[str, set[str]]:
    """openk3 module -> the openk3 modules it imports (anywhere in the file)."""
    mods = modules()
    graph = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name in mods)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                for a in node.names:
                    if f"{base}.{a.name}" in mods:
                        targets.add(f"{base}.{a.name}")
                    elif base in mods:
                        targets.add(base)
        targets.discard(name)
        graph[name] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
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


def test_the_walker_sees_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_graph_covers_the_package():
    graph = import_graph()
    assert "openk3.model" in graph and "openk3.layers.kda" in graph["openk3.model"]
    assert "openk3.config" in graph["openk3.presets"] or "openk3.presets" in graph["openk3.config"]


def test_no_import_circle_in_openk3():
    graph = import_graph()
    unexpected = [sorted(c) for c in circles(graph) if not any(c <= known for known in KNOWN)]
    detail = [{m: sorted(graph[m] & set(c)) for m in c} for c in unexpected]
    assert not unexpected, f"import circles: {detail}"
