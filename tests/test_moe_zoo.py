"""The HF MoE zoo (scripts/zoo_moe.py, issue 22): every sparse-MoE block of the installed transformers is
enumerated from its source and is vetted (its battery passes) or refused by name; a representative set runs in the
default suite, the whole zoo under `slow`."""

from __future__ import annotations

import importlib.util
import sys

import pytest
from test_route_layer import battery, failed

from tfmoe.contract.paths import CHECKOUT_ROOT

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def zoo():
    spec = importlib.util.spec_from_file_location("zoo_moe", CHECKOUT_ROOT / "scripts" / "zoo_moe.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["zoo_moe"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_enumeration_finds_the_known_blocks_from_source():
    """Regression (F-122): the class pattern wanted a single word as the base, so `class MixtralSparseMoeBlock(
    nn.Module)` never matched and the zoo enumerated 0 blocks."""
    blocks = {(b.model_type, b.name) for b in zoo().enumerate_blocks()}
    assert {("mixtral", "MixtralSparseMoeBlock"), ("qwen2_moe", "Qwen2MoeSparseMoeBlock"),
            ("deepseek_v3", "DeepseekV3MoE"), ("jamba", "JambaSparseMoeBlock"),
            ("granitemoe", "GraniteMoeMoE"), ("phimoe", "PhimoeSparseMoeBlock"),
            ("dbrx", "DbrxFFN")} <= blocks
    assert len(blocks) >= 60


def test_every_block_is_vetted_or_refused_by_name():
    from tfmoe.adapters.moe_hf import MODEL_TYPES, REFUSED

    z = zoo()
    for b in z.enumerate_blocks():
        vetted = MODEL_TYPES.get(b.model_type)
        assert (vetted is not None and vetted.block == b.name) or (
            f"{b.model_type}.{b.name}" in REFUSED or b.model_type in REFUSED), b
    for name, why in REFUSED.items():
        assert len(why) > 20, name  # a semantic, not a bare "no"


@pytest.mark.parametrize("model_type", ["jamba", "minimax", "qwen3_vl_moe", "qwen3_next", "dots1"])
def test_representative_newly_vetted_blocks_pass(model_type):
    from tfmoe.adapters.moe_hf import MODEL_TYPES

    if model_type not in MODEL_TYPES:
        pytest.skip(f"{model_type} not vetted in this transformers")
    rec = battery(f"impl=hf:{model_type}", "layer.seq=6")
    assert not failed(rec), [c for c in rec.checks_rows if not c.passed]


def test_a_refused_block_exits_2_naming_its_semantic():
    from tfmoe.adapters.moe_hf import REFUSED
    from tfmoe.contract.errors import BadInput

    z = zoo()
    assert "phimoe" in REFUSED and {b.model_type for b in z.enumerate_blocks()} >= {"phimoe"}
    with pytest.raises(BadInput, match="impl=hf:phimoe: refused: SparseMixer routing"):
        battery("impl=hf:phimoe")


@pytest.mark.slow
def test_the_whole_zoo_has_no_false_alarm():
    markdown, counts = zoo().section()
    assert counts.get("FAILS", 0) == 0 and counts.get("not vetted", 0) == 0, markdown
    assert counts["passes"] + counts["refused"] == counts["blocks"]
