"""Data flows one way: through tfmoe.components (masks -> attention -> block -> lm), and in each experiment's
package from its recipe (``__init__``) to its parts.

Read from the source with ``ast`` (every ``import``/``from ... import`` of a ``tfmoe.components`` module,
at module level or inside a function), so a lazy import that closes a cycle is found too: Python only
hides those until the function runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import test_import_cycles as whole  # the whole package's import graph (tests/ is on sys.path)
from test_import_cycles import find_cycle  # one cycle finder for both tests

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


def experiment_packages() -> list[str]:
    """Every experiment's package, from the registry (one package per experiment, issue 21)."""
    from tfmoe.contract.registry import EXPERIMENTS

    return sorted(f"tfmoe.experiments.{e.module}" for e in EXPERIMENTS.values())


def recipe_imported_by_a_part(graph: dict[str, set[str]]) -> list[str]:
    """``part -> recipe`` for every module inside an experiment's package that imports the package's recipe
    (its ``__init__``), TYPE_CHECKING imports included."""
    return sorted(f"{m} -> {pkg}" for pkg in experiment_packages() for m, deps in graph.items()
                  if m.startswith(pkg + ".") and pkg in deps)


def test_every_experiment_is_a_package_with_settings():
    names = whole.module_names()
    for pkg in experiment_packages():
        assert names[pkg].name == "__init__.py", f"{pkg} is a single module, not a package"
        assert f"{pkg}.settings" in names, f"{pkg} has no settings.py"


def test_experiment_parts_never_import_their_recipe():
    """A recipe imports its parts, the parts import each other one way and never the recipe."""
    graph = whole.import_graph(whole.package_sources())
    assert "tfmoe.experiments.complexity.measure" in graph["tfmoe.experiments.complexity"]
    assert "tfmoe.experiments.shift_labels.batch" in graph["tfmoe.experiments.shift_labels.checks"]
    assert recipe_imported_by_a_part(graph) == []


@pytest.mark.parametrize("planted", [
    "\n\ndef f():\n    from tfmoe.experiments.complexity import Settings\n",
    "\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tfmoe.experiments.complexity import Settings\n",
])
def test_parts_check_fails_when_a_part_imports_its_recipe(planted: str):
    sources = whole.package_sources()
    sources["tfmoe.experiments.complexity.checks"] += planted
    graph = whole.import_graph(sources)
    assert recipe_imported_by_a_part(graph) == ["tfmoe.experiments.complexity.checks -> tfmoe.experiments.complexity"]
    assert find_cycle(graph) is not None  # the recipe imports its checks


def test_find_cycle_boundaries():
    assert find_cycle({}) is None
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert component_imports("import os\nfrom tfmoe.contract.recorder import Recorder\n") == set()
