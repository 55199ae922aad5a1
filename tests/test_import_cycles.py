"""No import cycles anywhere in tfmoe: data flows one way (toolkit <- components <- experiments <- harness <- cli).

Read from the source with ``ast``: every ``import``/``from ... import`` of a tfmoe module, at module level, inside
a function (a lazy import only hides a cycle until the function runs) or under ``if TYPE_CHECKING:`` (an annotation
that needs its recipe draws the same circle in a picture of the imports, issue 21). The harness's four rooms import
one way: store <- method <- reading <- launching. tests/test_component_imports.py holds the finer rules inside
components/ and inside each experiment's package.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import tfmoe

SRC = Path(tfmoe.__file__).resolve().parent.parent


def _layout_graph():
    """scripts/layout_graph.py, which holds the one ast reader of tfmoe's imports (its drawing uses it too)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("layout_graph", SRC.parent / "scripts" / "layout_graph.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_reader = _layout_graph()
module_names = _reader.modules  # tfmoe module name -> its file
imported = _reader.imports  # the tfmoe modules a source imports anywhere (TYPE_CHECKING blocks included)


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
    assert {"tfmoe.cli", "tfmoe.contract.registry", "tfmoe.harness.store.notebook", "tfmoe.experiments.attn_check"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle or [])}"


def test_the_harness_is_imported_by_no_experiment_component_or_adapter() -> None:
    """Experiments get a Recorder; they never reach into the harness (launch, runner, notebook I/O...)."""
    graph = import_graph(package_sources())
    lower = [m for m in graph if m.startswith(("tfmoe.experiments", "tfmoe.components", "tfmoe.adapters"))]
    reaching = {m: sorted(d for d in graph[m] if d.startswith("tfmoe.harness")) for m in lower}
    assert not {m: d for m, d in reaching.items() if d}


@pytest.mark.parametrize("planted", [
    "def sync():\n    from tfmoe.harness.store import notebook  # a lazy import back\n",
    "from tfmoe.harness.store.notebook import read_parquet\n",
    "import tfmoe.harness.store.notebook\n",
])
def test_cycle_check_fails_on_a_planted_cycle(planted: str) -> None:
    sources = package_sources()
    notebook_deps = import_graph(sources)["tfmoe.harness.store.notebook"]
    target = next(iter(sorted(d for d in notebook_deps if d.startswith("tfmoe.harness"))), None)
    assert target is not None, "notebook imports no other harness module: pick another planted edge"
    sources[target] += "\n" + planted
    cycle = find_cycle(import_graph(sources))
    assert cycle is not None and "tfmoe.harness.store.notebook" in cycle


def test_type_checking_imports_count() -> None:
    """A part that imports its recipe only for an annotation still closes a circle (issue 21)."""
    graph = import_graph({"tfmoe.a": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tfmoe.b import B\n",
                          "tfmoe.b": "from tfmoe.a import A\n"})
    assert find_cycle(graph) == ["tfmoe.a", "tfmoe.b", "tfmoe.a"]


ROOMS = ("store", "method", "reading", "launching")  # bottom to top


def room_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 3 and parts[1] == "harness" else None


def upward_room_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports from a harness room into a room above it."""
    return sorted(f"{m} -> {d}" for m, deps in graph.items() if (r := room_of(m))
                  for d in deps if (rd := room_of(d)) and ROOMS.index(rd) > ROOMS.index(r))


def test_harness_rooms_import_one_way() -> None:
    graph = import_graph(package_sources())
    rooms = {room_of(m) for m in graph} - {None}
    assert rooms == set(ROOMS), f"harness rooms changed: {sorted(rooms)}; update ROOMS and the harness docstring"
    flat = [m for m in graph if m.startswith("tfmoe.harness.") and room_of(m) is None and m.count(".") == 2
            and m.rsplit(".", 1)[1] not in ROOMS]
    assert flat == [], f"harness modules outside a room: {flat}"
    assert upward_room_imports(graph) == []


def test_room_check_fails_on_an_upward_import() -> None:
    sources = package_sources()
    sources["tfmoe.harness.store.rundir"] += "\n\ndef f():\n    from tfmoe.harness.reading import reports\n"
    assert upward_room_imports(import_graph(sources)) == ["tfmoe.harness.store.rundir -> tfmoe.harness.reading.reports"]


def test_pyproject_lists_every_package() -> None:
    """A non-editable install ships only the packages pyproject.toml names: a new sub-package must be listed."""
    import tomllib

    listed = set(tomllib.loads((SRC.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {name for name, path in module_names().items() if path.name == "__init__.py"}
    assert packages - listed == set(), f"add to pyproject.toml [tool.setuptools] packages: {sorted(packages - listed)}"
