"""The HF MoE zoo: every sparse-MoE block of the installed transformers, vetted or refused by name.

Enumerated from transformers' own model modules, without importing them: every ``class <Name>(`` in a
``models/<type>/modeling_<type>.py`` whose name ends in SparseMoeBlock, MoE, Moe or MoeBlock (plus
``EXTRA_BLOCKS``, named otherwise: DBRX's ``DbrxFFN``). Each block is then

- **vetted** (``tfmoe.adapters.moe_hf.MODEL_TYPES``): its route-sim battery (``impl=hf:<type>``, tiny config, nothing
  downloaded) is run here, and the verdict printed is the battery's: passes, or FAILS with the checks;
- **refused** by name (``moe_hf.REFUSED``): the semantic its block needs that the reference does not model, read from
  its source;
- **not vetted**: in neither table (new in this transformers release): ``impl=hf:<type>`` exits 2.

``python scripts/zoo_moe.py`` prints the section; ``python scripts/zoo_moe.py --explore`` also runs, for every type
not yet vetted whose modular file inherits a vetted block, the battery under that parent's layout (how
MODEL_TYPES grew: a candidate is added only when it passes and its source was read).
``scripts/zoo.py`` imports this module and calls :func:`section`.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

TITLE: str = "MoE blocks of transformers (`route-sim impl=hf:<model_type>`)"
# Sparse-MoE blocks whose class names do not follow the pattern (found by reading their modeling files).
EXTRA_BLOCKS: dict[str, str] = {"dbrx": "DbrxFFN"}
BLOCK = re.compile(r"^class (\w+(?:SparseMoeBlock|MoE|Moe|MoeBlock))\(([\w.]*)", re.M)


@dataclass(frozen=True)
class Block:
    model_type: str
    name: str  # the class in modeling_<type>.py
    parent: str  # its base in modular_<type>.py ('' when the type has no modular file or the class is new there)


def models_dir() -> Path:
    import transformers

    return Path(transformers.__file__).parent / "models"


def enumerate_blocks() -> list[Block]:
    """Every sparse-MoE block class of the installed transformers, by source scan."""
    root = models_dir()
    blocks = []
    for modeling in sorted(root.glob("*/modeling_*.py")):
        model_type = modeling.parent.name
        if modeling.name != f"modeling_{model_type}.py":
            continue
        modular = modeling.with_name(f"modular_{model_type}.py")
        parents = dict(BLOCK.findall(modular.read_text())) if modular.exists() else {}
        text = modeling.read_text()
        names = [name for name, _base in BLOCK.findall(text)]
        extra = EXTRA_BLOCKS.get(model_type)
        if extra and re.search(rf"^class {extra}\(", text, re.M):
            names.append(extra)
        for name in names:
            blocks.append(Block(model_type, name, parents.get(name, "")))
    return blocks


def _battery(model_type: str, entry: object = None) -> tuple[str, str]:
    """(passes | FAILS | raised, detail) of route-sim's battery on one block."""
    from tfmoe.adapters.moe_hf import HFBlock
    from tfmoe.api.testing import compose, make_recorder
    from tfmoe.contract.errors import BadInput
    from tfmoe.experiments import route_sim
    from tfmoe.experiments.route_sim import layer as route_layer

    cfg = compose("route-sim", ["steps=0", f"impl=hf:{model_type}", "layer.seq=8"])
    rec = make_recorder(cfg)
    settings = route_sim.settings(cfg).layer
    try:
        if entry is None:
            route_layer.run_battery(settings, rec)
        else:  # an unlisted type under a candidate layout (--explore)
            original = route_layer.load_layer
            route_layer.load_layer = lambda impl, sizes, seq=12: HFBlock(model_type, sizes, entry)
            try:
                route_layer.run_battery(settings, rec)
            finally:
                route_layer.load_layer = original
    except BadInput as exc:
        return "refused", str(exc)
    except Exception as exc:  # noqa: BLE001 - an exploration verdict, not a check
        return "raised", f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    bad = [c.check.removeprefix("layer.") for c in rec.checks_rows if not c.passed]
    judged = len(rec.checks_rows)
    return ("FAILS", f"{', '.join(bad)} ({judged - len(bad)}/{judged} pass)") if bad else \
        ("passes", f"{judged}/{judged} checks pass")


def vet() -> list[tuple[Block, str, str]]:
    """(block, verdict, detail) for every enumerated block."""
    from tfmoe.adapters.moe_hf import MODEL_TYPES, REFUSED

    rows = []
    for b in enumerate_blocks():
        entry = MODEL_TYPES.get(b.model_type)
        why = REFUSED.get(f"{b.model_type}.{b.name}") or REFUSED.get(b.model_type)
        if entry is not None and entry.block == b.name:
            verdict, detail = _battery(b.model_type)
            rows.append((b, verdict, f"layout {entry.layout} ({entry.evidence or 'one of the first vetted layouts'}): {detail}"))
        elif why:
            rows.append((b, "refused", why))
        else:
            rows.append((b, "not vetted", "in neither MODEL_TYPES nor REFUSED (new in this release): exits 2"))
    return rows


def section() -> tuple[str, dict[str, int]]:
    """The zoo's MoE section (markdown) and its counts."""
    import transformers

    rows = vet()
    counts: dict[str, int] = {"blocks": len(rows)}
    for _, verdict, _ in rows:
        counts[verdict] = counts.get(verdict, 0) + 1
    lines = [f"## {TITLE}", "",
             f"transformers {transformers.__version__}: {len(rows)} sparse-MoE blocks, "
             + ", ".join(f"{v} {n}" for v, n in counts.items() if v != "blocks") + ".", "",
             "| model type | block | verdict | detail |", "|---|---|---|---|"]
    for b, verdict, detail in rows:
        lines.append(f"| `{b.model_type}` | `{b.name}` | {verdict} | {detail.replace('|', '/')} |")
    return "\n".join(lines), counts


def explore() -> list[str]:
    """Candidates: unvetted blocks whose modular parent chain reaches a vetted block, run under its layout."""
    from tfmoe.adapters.moe_hf import MODEL_TYPES

    blocks = enumerate_blocks()
    parent = {b.name: b.parent for b in blocks}
    vetted = {e.block: e for e in MODEL_TYPES.values()}
    out = []
    for b in blocks:
        if b.model_type in MODEL_TYPES:
            continue
        name, seen = b.name, set()
        while name and name not in vetted and name not in seen:
            seen.add(name)
            name = parent.get(name, "")
        if name in vetted:
            from tfmoe.adapters.moe_hf import ModelType

            entry = ModelType(vetted[name].layout, b.name)
            verdict, detail = _battery(b.model_type, entry)
            out.append(f"{b.model_type}\t{b.name}\t<- {name} ({entry.layout})\t{verdict}\t{detail}")
        else:
            out.append(f"{b.model_type}\t{b.name}\tno vetted ancestor ({b.parent or 'no modular base'})")
    return out


if __name__ == "__main__":
    if "--explore" in sys.argv:
        print("\n".join(explore()))
    else:
        markdown, counts = section()
        print(markdown)
        print(counts)
