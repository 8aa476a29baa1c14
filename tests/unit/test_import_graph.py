"""The library's imports form no circle: every `import` / `from ... import` of one sft_recipe module by another,
at module level or inside a function (a lazy import closes a circle as surely as a top-level one), read from the
source with `ast`, and searched for strongly connected components."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import REPO


def _modules() -> dict[str, Path]:
    found = {}
    for path in (REPO / "sft_recipe").rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                # `from pkg import mod` imports the module pkg.mod; `from pkg.mod import name` the module pkg.mod
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_finder_sees_a_circle_made_of_lazy_imports():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_the_library_has_no_import_circle():
    graph = import_graph()
    assert len(graph) > 50 and graph["sft_recipe.preflight.validate"]  # the graph was read, edges included
    assert circles(graph) == []


def test_the_error_type_and_the_model_shape_stand_on_the_ground_floor():
    graph = import_graph()
    assert graph["sft_recipe.errors"] == set() and graph["sft_recipe.model.shape"] == set()
    assert graph["sft_recipe.model.reach"] <= {"sft_recipe.model.shape"}
    assert "sft_recipe.config.args" not in graph["sft_recipe.config.launch_env"]


# The floors, lowest first; a module may import its own floor or any below, never one above (a circle within a
# floor is the test above's). Ground: what every room uses, knowing nothing of the rooms.
FLOORS = [
    ("ground", {"errors", "model", "atomic", "logs", "measure", "scoring", "compat"}),
    ("settings", {"config", "startup"}),
    ("data", {"data"}),
    ("plan", {"plan"}),
    ("artifacts", {"artifacts"}),
    ("train", {"train"}),
    ("preflight", {"preflight"}),
    ("tools", {"merge", "merge_checks", "evaluate", "tiny"}),
]


def floor_of(module: str) -> int:
    parts = module.split(".")
    room = parts[1] if len(parts) > 1 else ""
    for number, (_, rooms) in enumerate(FLOORS):
        if room in rooms:
            return number
    if module == "sft_recipe":
        return 0
    raise AssertionError(f"{module}: on no floor; add its package to FLOORS")


def upward_arrows(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if floor_of(b) > floor_of(a))


def test_the_finder_sees_an_arrow_running_up():
    assert upward_arrows({"sft_recipe.config.args": {"sft_recipe.train.model"}, "sft_recipe.train.model": set()}) \
        == ["sft_recipe.config.args -> sft_recipe.train.model"]
    assert upward_arrows({"sft_recipe.train.model": {"sft_recipe.config.args"}, "sft_recipe.config.args": set()}) == []


def test_no_import_runs_up_a_floor():
    graph = import_graph()
    assert {floor_of(m) for m in graph} == set(range(len(FLOORS)))  # every floor is inhabited, every module placed
    assert upward_arrows(graph) == []
