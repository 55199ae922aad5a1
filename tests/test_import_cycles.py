"""No import cycles anywhere in tfmoe: data flows one way (toolkit <- components <- experiments <- harness <- cli).

Read from the source with ``ast``: every ``import``/``from ... import`` of a tfmoe module, at module level or inside
a function (a lazy import only hides a cycle until the function runs); imports under ``if TYPE_CHECKING:`` are
annotations, not data flow, and are left out. tests/test_component_imports.py holds the finer rules inside
components/.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import tfmoe

SRC = Path(tfmoe.__file__).resolve().parent.parent


def module_names(src: Path = SRC) -> dict[str, Path]:
    names = {}
    for path in (src / "tfmoe").rglob("*.py"):
        parts = path.relative_to(src).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imported(source: str, modules: set[str]) -> set[str]:
    """The tfmoe modules a source imports anywhere, outside ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(source)
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and getattr(block.test, "id", getattr(block.test, "attr", "")) == "TYPE_CHECKING"
                   for n in ast.walk(block)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:  # from pkg import submodule, or from module import name
                full = f"{node.module}.{a.name}"
                found.add(full if full in modules else node.module)
    return found & modules


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    modules = set(sources)
    return {name: imported(text, modules) - {name} for name, text in sources.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path ``[a, b, ..., a]``, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                full = path + [node]
                return full[full.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt, path + [node])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [])):
            return cycle
    return None


def package_sources() -> dict[str, str]:
    return {name: path.read_text() for name, path in module_names().items()}


def test_tfmoe_has_no_import_cycle() -> None:
    graph = import_graph(package_sources())
    assert {"tfmoe.cli", "tfmoe.registry", "tfmoe.harness.notebook", "tfmoe.experiments.attn_check"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle or [])}"


def test_the_harness_is_imported_by_no_experiment_component_or_adapter() -> None:
    """Experiments get a Recorder; they never reach into the harness (launch, runner, notebook I/O...)."""
    graph = import_graph(package_sources())
    lower = [m for m in graph if m.startswith(("tfmoe.experiments", "tfmoe.components", "tfmoe.adapters"))]
    reaching = {m: sorted(d for d in graph[m] if d.startswith("tfmoe.harness")) for m in lower}
    assert not {m: d for m, d in reaching.items() if d}


@pytest.mark.parametrize("planted", [
    "def sync():\n    from tfmoe.harness import notebook  # a lazy import back\n",
    "from tfmoe.harness.notebook import read_parquet\n",
    "import tfmoe.harness.notebook\n",
])
def test_cycle_check_fails_on_a_planted_cycle(planted: str) -> None:
    sources = package_sources()
    notebook_deps = import_graph(sources)["tfmoe.harness.notebook"]
    target = next(iter(sorted(d for d in notebook_deps if d.startswith("tfmoe.harness"))), None)
    assert target is not None, "notebook imports no other harness module: pick another planted edge"
    sources[target] += "\n" + planted
    cycle = find_cycle(import_graph(sources))
    assert cycle is not None and "tfmoe.harness.notebook" in cycle


def test_type_checking_imports_are_not_data_flow() -> None:
    graph = import_graph({"tfmoe.a": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tfmoe.b import B\n",
                          "tfmoe.b": "from tfmoe.a import A\n"})
    assert find_cycle(graph) is None
