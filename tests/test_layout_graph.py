"""docs/layout.md's drawing of which part imports which is generated from the code and current."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("layout_graph", REPO / "scripts" / "layout_graph.py")
layout_graph = importlib.util.module_from_spec(spec)
spec.loader.exec_module(layout_graph)


def test_the_drawing_in_docs_layout_is_current() -> None:
    assert layout_graph.main(["--check"]) == 0, "run: python scripts/layout_graph.py"


def test_the_drawing_has_every_part_and_the_rooms_import_one_way() -> None:
    pairs = layout_graph.edges()
    parts = {p for pair in pairs for p in pair}
    experiments = {p.name for p in (REPO / "src" / "tfmoe" / "experiments").iterdir() if (p / "__init__.py").exists()}
    assert {f"experiments/{e}" for e in experiments} | {"rules", "contract", "api", "components", "adapters", "cli", "registry",
                                                        "harness/store", "harness/method", "harness/reading",
                                                        "harness/launching"} <= parts
    rooms = ["harness/store", "harness/method", "harness/reading", "harness/launching"]
    for a, b in pairs:
        if a in rooms and b in rooms:
            assert rooms.index(a) > rooms.index(b), (a, b)  # store <- method <- reading <- launching
        assert not (a.startswith(("experiments/", "components", "adapters", "rules", "contract")) and b.startswith("harness"))


def test_a_new_import_makes_the_drawing_stale(tmp_path: Path) -> None:
    """A planted import (components -> harness/store) in a copy of the source shows up as a new edge, and the
    docs' block no longer matches it."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(REPO / "src" / "tfmoe", src / "tfmoe")
    mask = src / "tfmoe" / "components" / "masks.py"
    mask.write_text(mask.read_text(encoding="utf-8") + "\n\ndef _planted():\n    from tfmoe.harness.store import rundir\n")
    planted = layout_graph.edges(src)
    assert set(planted) - set(layout_graph.edges()) == {("components", "harness/store")}
    text = (REPO / "docs" / "layout.md").read_text(encoding="utf-8")
    assert layout_graph.with_graph(text, layout_graph.render(planted)) != text


def test_part_of_boundaries() -> None:
    assert layout_graph.part_of("tfmoe.experiments.route_sim.layer") == "experiments/route_sim"
    assert layout_graph.part_of("tfmoe.experiments.attn_check.checks.masks") == "experiments/attn_check"
    assert layout_graph.part_of("tfmoe.harness.store.notebook") == "harness/store"
    assert layout_graph.part_of("tfmoe.contract.recorder") == "contract" and layout_graph.part_of("tfmoe") == "package"
    assert layout_graph.part_of("tfmoe.cli") == "cli" and layout_graph.part_of("tfmoe.contract.registry") == "registry"
