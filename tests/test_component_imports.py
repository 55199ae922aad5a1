"""Data flows one way: through tfmoe.components (masks -> attention -> block -> lm), and from a recipe to its parts.

Read from the source with ``ast`` (every ``import``/``from ... import`` of a ``tfmoe.components`` module,
at module level or inside a function), so a lazy import that closes a cycle is found too: Python only
hides those until the function runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from test_import_cycles import find_cycle  # one cycle finder for both tests (tests/ is on sys.path)

import tfmoe.components

PACKAGE = "tfmoe.components"
FOLDER = Path(tfmoe.components.__file__).parent


def component_imports(source: str) -> set[str]:
    """The ``tfmoe.components`` modules a source file imports anywhere in it (module names without the package)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == PACKAGE:  # from tfmoe.components import block
                found.update(a.name for a in node.names)
            elif node.module.startswith(PACKAGE + "."):
                found.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[2] for a in node.names if a.name.startswith(PACKAGE + "."))
    return found


def import_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    return {name: component_imports(src) - {name} for name, src in sources.items()}


def package_sources() -> dict[str, str]:
    return {p.stem: p.read_text() for p in FOLDER.glob("*.py") if p.stem != "__init__"}


def test_components_have_no_import_cycle():
    graph = import_graph(package_sources())
    assert {"block", "lm", "positions", "attention", "masks"} <= set(graph)
    assert find_cycle(graph) is None, f"import cycle among {PACKAGE}: {' -> '.join(find_cycle(graph) or [])}"


def test_data_flows_masks_attention_block_lm():
    graph = import_graph(package_sources())
    assert "block" in graph["lm"] and "attention" in graph["block"] and "masks" in graph["attention"]
    assert "lm" not in graph["block"] and "lm" not in graph["positions"]


@pytest.mark.parametrize("planted", [
    "def embed(idx):\n    from tfmoe.components.lm import sinusoidal_positions  # the old lazy import\n",
    "from tfmoe.components import lm\n",
    "import tfmoe.components.lm\n",
])
def test_cycle_check_fails_on_the_old_lazy_import(planted):
    """Plant block.py's old lazy import of lm (lm imports block) back: the check finds the cycle."""
    sources = package_sources()
    sources["block"] += "\n\n" + planted
    cycle = find_cycle(import_graph(sources))
    assert cycle is not None and {"block", "lm"} <= set(cycle), cycle


RECIPES = ("arch", "block_stats", "complexity", "shift_labels")  # recipes split into parts (issue 12 item 1)


def experiment_part_sources() -> dict[str, str]:
    """The sources of RECIPES and their parts (``experiments/<recipe>*.py``), by module name."""
    folder = FOLDER.parent / "experiments"
    return {p.stem: p.read_text() for r in RECIPES for p in folder.glob(f"{r}*.py")}


def parts_graph(sources: dict[str, str]) -> dict[str, set[str]]:
    """Imports among those modules, module level or lazy."""
    graph: dict[str, set[str]] = {}
    for name, source in sources.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and node.module == "tfmoe.experiments":
                deps.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tfmoe.experiments."):
                deps.add(node.module.split(".")[2])
        graph[name] = deps & set(sources) - {name}
    return graph


def recipe_imported_by_a_part(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{part} -> {r}" for part, deps in graph.items() for r in RECIPES if r in deps)


def test_experiment_parts_never_import_their_recipe():
    """A recipe imports its parts, the parts import each other one way and never the recipe."""
    graph = parts_graph(experiment_part_sources())
    assert {"complexity_measure", "block_stats_checks", "arch_trace", "shift_labels_batch"} <= set(graph)
    assert "complexity_measure" in graph["complexity"] and "shift_labels_batch" in graph["shift_labels_checks"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])
    assert recipe_imported_by_a_part(graph) == []


def test_parts_check_fails_when_a_part_imports_its_recipe():
    sources = experiment_part_sources()
    sources["complexity_checks"] += "\n\ndef f():\n    from tfmoe.experiments.complexity import Settings\n"
    graph = parts_graph(sources)
    assert recipe_imported_by_a_part(graph) == ["complexity_checks -> complexity"]
    assert find_cycle(graph) is not None  # the recipe imports its checks


def test_find_cycle_boundaries():
    assert find_cycle({}) is None
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert component_imports("import os\nfrom tfmoe.recorder import Recorder\n") == set()
