"""The Hugging Face attention zoo (issue 22, items 2-4): the supported transformers range, both RoPE pairings in
the reference, every vetted model type checked against the reference (that IS the check of its table row against
the model's source), every other type refused by name, planted bugs inside the vetted path caught."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_attn_check import FAST, failed

from tfmoe.api.testing import run_cli, run_recorded
from tfmoe.components.references import Rope, rotate, sdpa_attention, visibility
from tfmoe.contract.errors import BadInput

pytestmark = pytest.mark.usefixtures("one_torch_thread")
SMALL = ["d_model=16", "n_heads=4", "T=6", *FAST]
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
transformers = pytest.importorskip("transformers", reason="the `hf` extra (transformers 5.x) is not installed")

from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402

from tfmoe.adapters.huggingface import (  # noqa: E402
    VETTED,
    HuggingFace,
    Vetted,
    sdpa_declared_false,
    takes_kv_heads,
)
from tfmoe.adapters.transformers_support import SUPPORTED, in_range, installed_version  # noqa: E402


def installed(model_type: str) -> None:
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {model_type}")


# ------------------------------------------------------------------------------------ the RoPE pairings
def test_interleaved_rope_is_rotate_half_on_the_pairs_regrouped():
    """From first principles: interleaved pairs (2i, 2i+1) regrouped as (i, i + d/2) rotate exactly like
    rotate-half, at the same angles; both preserve each pair's norm."""
    t = torch.randn(2, 3, 5, 8, dtype=torch.float64)
    pos = torch.arange(5)
    to_half = torch.cat([torch.arange(0, 8, 2), torch.arange(1, 8, 2)])  # dims 0 2 4 6 | 1 3 5 7
    inter = rotate(t, Rope(10000.0, 8, "interleaved"), pos)
    half = rotate(t[..., to_half], Rope(10000.0, 8, "half"), pos)
    torch.testing.assert_close(inter[..., to_half], half, rtol=0, atol=1e-12)
    assert (inter - rotate(t, Rope(10000.0, 8, "half"), pos)).abs().max() > 0.1  # the two are different maps
    pairs = inter.reshape(2, 3, 5, 4, 2).norm(dim=-1)
    torch.testing.assert_close(pairs, t.reshape(2, 3, 5, 4, 2).norm(dim=-1), rtol=0, atol=1e-12)
    plain = rotate(t.float(), Rope(10000.0, 8, "interleaved"), pos, exact=False)  # the same-dtype yardstick
    torch.testing.assert_close(plain.double(), inter, rtol=0, atol=1e-5)


def test_rope_pairing_must_be_known():
    with pytest.raises(ValueError, match="pairing"):
        Rope(10000.0, 8, "gptj")


# ---------------------------------------------------------------- every table row against the reference
def _max_err(model_type: str, attn: str, pairing: str | None = None, causal: bool | None = None,
             vetted: Vetted | None = None) -> float:
    """The tiny model's layer (GQA for the Llama layout) vs the fp64 reference: the worst of a padded batch and an
    unpadded one (where the model's mask builder returns None and sdpa falls back on the class's is_causal)."""
    row = VETTED[model_type] if vetted is None else vetted
    if pairing is not None:
        row = replace(row, rope=pairing)
    adapter = HuggingFace(model_type, attn, vetting=row)
    causal = row.causal[0] if causal is None else causal
    hkv = 2 if row.layout == "llama" and takes_kv_heads(model_type) else 4
    m = adapter.build(16, 4, n_kv_heads=hkv, causal=causal, dropout=0.0, seed=0, dtype=torch.float32,
                      device=torch.device("cpu"))
    p = adapter.projections(dict(m.named_parameters()), 4, hkv)
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(0))  # (B,T,D)
    pm = torch.ones(2, 6, dtype=torch.bool)
    pm[1, 4:] = False
    worst = 0.0
    for padding in (pm, None):
        with torch.no_grad():
            out, _ = adapter.forward(m, x, padding, causal=causal)
        ref = sdpa_attention(x.double(), p.to(torch.float64), visibility(6, 6, causal, padding))
        worst = max(worst, float((out.double() - ref)[pm if padding is not None else slice(None)].abs().max()))
    return worst


def _sdpa_refused(model_type: str) -> bool:
    return bool(sdpa_declared_false(HuggingFace(model_type).modeling, CONFIG_MAPPING[model_type]))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("model_type", sorted(VETTED))
def test_every_vetted_row_matches_the_reference(model_type, attn):
    """Each causal setting the row declares matches the reference, padded and unpadded; the other exits 2, and so
    does sdpa where the model itself declares _supports_sdpa=False."""
    installed(model_type)
    row = VETTED[model_type]
    if attn == "sdpa" and _sdpa_refused(model_type):
        with pytest.raises(BadInput, match="_supports_sdpa=False.*hf.attn_implementation=eager"):
            _max_err(model_type, attn)
        return
    for causal in row.causal:
        assert _max_err(model_type, attn, causal=causal) < 2e-6, causal
    for causal in {True, False} - set(row.causal):
        with pytest.raises(BadInput, match="an encoder's.*causal=false" if causal else "a decoder's.*causal=true"):
            _max_err(model_type, attn, causal=causal)
    if row.rope is not None and attn == "eager":  # the recorded pairing is the one that matches
        other = "half" if row.rope == "interleaved" else "interleaved"
        assert _max_err(model_type, attn, other) > 1e-2


@pytest.mark.parametrize("model_type", ["gte", "nomic_bert"])
def test_an_encoder_row_declared_a_decoder_is_caught(model_type, monkeypatch):
    """A planted wrong row: a Llama-layout encoder (is_causal=False) recorded as a decoder and run causal=true.
    Its model's causal mask is None when nothing is padded, so sdpa runs the class's is_causal=False: the layer
    attends both ways and sdpa_match fails, as it must (before the row recorded causal, eurobert was refused for
    this; now the right row refuses causal=true instead)."""
    installed(model_type)
    monkeypatch.setitem(VETTED, model_type, replace(VETTED[model_type], causal=(True,)))
    rec = run_recorded("attn-check", [*SMALL, f"impl=hf:{model_type}", "hf.attn_implementation=sdpa", "lengths=[6,6]",
                                      "checks=[sdpa]"])
    assert "sdpa_match" in failed({c.check: c for c in rec.checks_rows})


def test_an_encoder_run_as_a_decoder_exits_2_by_name():
    installed("gte")
    with pytest.raises(BadInput, match=r"GteAttention is an encoder's \(is_causal=False.*pass causal=false") as err:
        run_recorded("attn-check", [*SMALL, "impl=hf:gte", "causal=true", "checks=[sdpa]"])
    assert "\n" not in str(err.value)
    rec = run_recorded("attn-check", [*SMALL, "impl=hf:gte", "causal=false", "checks=[masks,sdpa,gradients,invariances]"])
    checks = {c.check: c for c in rec.checks_rows}
    assert failed(checks) == set() and "sdpa_match" in checks, {n: checks[n].detail for n in failed(checks)}


def test_sdpa_where_the_model_declares_no_sdpa_exits_2_by_name():
    """AlignTextModel._supports_sdpa is False (transformers refuses sdpa for it) and AlignTextSelfAttention has no
    is_causal, so under sdpa an unpadded batch would attend causally: the adapter refuses sdpa, eager passes."""
    installed("align_text_model")
    with pytest.raises(BadInput, match=r"_supports_sdpa=False \(AlignTextModel") as err:
        run_recorded("attn-check", [*SMALL, "impl=hf:align_text_model", "causal=false",
                                    "hf.attn_implementation=sdpa", "checks=[sdpa]"])
    assert "\n" not in str(err.value)


def test_a_legacy_extended_mask_row_driven_with_masking_utils_is_caught(monkeypatch):
    """A planted wrong row: layoutlm (its model always passes the additive extended mask; its attention has no
    is_causal) recorded as taking masking_utils' mask, which is None when nothing is padded: sdpa then defaults to
    is_causal=True and the encoder attends causally, which sdpa_match catches."""
    installed("layoutlm")
    if _sdpa_refused("layoutlm"):  # transformers 5.13's LayoutLM declares _supports_sdpa=False: eager only
        pytest.skip(f"transformers {transformers.__version__}'s LayoutLM has no sdpa path")
    monkeypatch.setitem(VETTED, "layoutlm", replace(VETTED["layoutlm"], mask="masking_utils"))
    rec = run_recorded("attn-check", [*SMALL, "impl=hf:layoutlm", "causal=false", "hf.attn_implementation=sdpa",
                                      "lengths=[6,6]", "checks=[sdpa]"])
    assert "sdpa_match" in failed({c.check: c for c in rec.checks_rows})


# ----------------------------------------------------------------------------- the battery on the zoo
ZOO = [("hf:llama", ["n_kv_heads=2"]), ("hf:cohere", []), ("hf:helium", ["n_kv_heads=2"]), ("hf:ernie4_5", []),
       ("hf:gpt2", []), ("hf:bert", ["causal=false"]), ("hf:bert", ["causal=true"]),
       ("hf:eurobert", ["causal=false", "n_kv_heads=2"]), ("hf:roformer", ["causal=false"]),
       ("hf:layoutlm", ["causal=false"]), ("hf:align_text_model", ["causal=false"])]


@pytest.mark.parametrize(("spec", "extra"), ZOO, ids=[" ".join([s, *e]) for s, e in ZOO])
def test_each_rope_convention_and_gqa_passes_the_battery(spec, extra):
    """Before: cohere, helium and ernie4_5 were read as rotate-half and failed sdpa_match (0.055 vs 1.4e-7), with
    a √d_model scale named as the likely cause. One row per new kind too: a Llama-layout encoder with GQA, RoPE in
    the bert layout, a legacy extended mask, an eager-only model (the default implementation, eager)."""
    installed(spec.removeprefix("hf:"))
    rec = run_recorded("attn-check", [*SMALL, f"impl={spec}", "checks=[masks,sdpa,gradients,invariances]", *extra])
    checks = {c.check: c for c in rec.checks_rows}
    assert failed(checks) == set() and "sdpa_match" in checks, {n: checks[n].detail for n in failed(checks)}


@pytest.mark.slow
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("model_type", sorted(VETTED))
def test_every_vetted_type_passes_the_whole_battery(model_type, attn):
    """Zero false alarms on the full list (the zoo's sweeps run the same; experiments/zoo.md names the runs)."""
    installed(model_type)
    if attn == "sdpa" and _sdpa_refused(model_type):
        pytest.skip(f"{model_type}'s model declares _supports_sdpa=False: sdpa exits 2")
    row = VETTED[model_type]
    extra = (["n_kv_heads=2"] if row.layout == "llama" and takes_kv_heads(model_type) else []) + (
        ["causal=false"] if False in row.causal else [])
    rec = run_recorded("attn-check", [*SMALL, f"impl=hf:{model_type}", f"hf.attn_implementation={attn}", *extra])
    checks = {c.check: c for c in rec.checks_rows}
    assert failed(checks) == set(), {n: checks[n].detail for n in failed(checks)}


REFUSED = [("qwen3", "q/k norm"), ("nanochat", "q/k norm"), ("gemma2", "softcapping"), ("phi", "partial RoPE"),
           ("phi3", "fused qkv"), ("granite", "non-standard scale"), ("gpt_oss", "scaled RoPE"),
           ("cohere2", "NoPE"), ("jamba", "no rotary position_embeddings"),
           ("yoso", "approximate attention"), ("mra", "approximate attention"), ("big_bird", "block-sparse"),
           ("layoutlmv3", "position biases"),
           ("dpt", "no attention mask"), ("mobilebert", "separate query/key/value"), ("lxmert", "cross-attention"),
           ("glm4v_text", "multimodal RoPE"), ("neucodec", "RoPE over attention heads"),
           ("ultrabert", "per-layer-type RoPE"), ("mimo_v2_flash", "attention sinks"),
           ("unlimited_ocr_text", "does not repeat kv heads")]


@pytest.mark.parametrize(("model_type", "fragment"), REFUSED, ids=[m for m, _ in REFUSED])
def test_unmodelled_semantics_are_refused_by_name(model_type, fragment):
    installed(model_type)
    with pytest.raises(BadInput, match=fragment) as err:
        run_recorded("attn-check", [*SMALL, f"impl=hf:{model_type}", "checks=[sdpa]"])
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("model_type", "inputs"), [("layoutlmv3", "position_bias|rel_pos"),  # 5.24 | 5.13
                                                  ("roformer", "sinusoidal_pos"), ("mobilebert", "query_tensor")])
def test_a_layer_taking_inputs_the_adapter_does_not_supply_is_refused(model_type, inputs, monkeypatch):
    """Without its source note, layoutlmv3 would run without its position_bias and pass (1.8e-7 from the
    reference), and roformer without its sinusoidal_pos (its RoPE) too: verdicts on layers their models never run.
    The screen reads the forward's parameters; only roformer's own row, whose RoPE the adapter supplies, lifts it."""
    from tfmoe.adapters import huggingface

    installed(model_type)
    monkeypatch.delitem(huggingface.UNMODELLED_SOURCE, model_type, raising=False)
    monkeypatch.delitem(VETTED, model_type, raising=False)
    with pytest.raises(BadInput, match=f"forward takes .*({inputs}).*inputs beyond the mask"):
        run_recorded("attn-check", [*SMALL, f"impl=hf:{model_type}", "causal=false", "checks=[sdpa]"])
    monkeypatch.setitem(VETTED, model_type, Vetted("bert", None, "a wrong row", causal=(False,)))
    with pytest.raises(BadInput, match=inputs):  # a row does not lift the screen
        run_recorded("attn-check", [*SMALL, f"impl=hf:{model_type}", "causal=false", "checks=[sdpa]"])


def test_a_model_type_not_in_the_table_is_refused_as_not_vetted(monkeypatch):
    """No more "any model with the Llama layout": a layer that passes every static screen is still refused
    until its row is in the table."""
    monkeypatch.delitem(VETTED, "mistral")
    with pytest.raises(BadInput, match="not vetted yet.*Llama|not vetted yet.*llama layout"):
        run_recorded("attn-check", [*SMALL, "impl=hf:mistral", "checks=[sdpa]"])


# ------------------------------------------------------------------ planted bugs inside the vetted path
def test_rotate_half_planted_in_an_interleaved_model_is_caught(monkeypatch):
    from transformers.models.cohere import modeling_cohere
    from transformers.models.llama import modeling_llama

    monkeypatch.setattr(modeling_cohere, "rotate_half", modeling_llama.rotate_half)  # Llama's pairs in Cohere
    rec = run_recorded("attn-check", [*SMALL, "impl=hf:cohere", "checks=[sdpa]"])
    assert failed({c.check: c for c in rec.checks_rows}) == {"sdpa_match", "left_padding_match"}


def test_rotate_half_planted_in_roformer_is_caught(monkeypatch):
    """RoPE inside a bert-layout layer: RoFormer's interleaved pairs replaced by rotate-half ones, at the same
    angles, in the layer's own apply_rotary_position_embeddings."""
    from transformers.models.roformer import modeling_roformer

    def half_pairs(sinusoidal_pos, query_layer, key_layer, value_layer=None):
        sin, cos = sinusoidal_pos.chunk(2, dim=-1)
        sin, cos = torch.cat([sin, sin], dim=-1), torch.cat([cos, cos], dim=-1)

        def rotated(t):
            return torch.cat([-t[..., t.shape[-1] // 2:], t[..., :t.shape[-1] // 2]], dim=-1)

        return query_layer * cos + rotated(query_layer) * sin, key_layer * cos + rotated(key_layer) * sin

    installed("roformer")
    monkeypatch.setattr(modeling_roformer.RoFormerSelfAttention, "apply_rotary_position_embeddings",
                        staticmethod(half_pairs))
    rec = run_recorded("attn-check", [*SMALL, "impl=hf:roformer", "causal=false", "checks=[sdpa]"])
    assert failed({c.check: c for c in rec.checks_rows}) == {"sdpa_match", "left_padding_match"}


def test_a_wrong_scale_planted_in_the_layer_is_caught(monkeypatch):
    """1/sqrt(d_model) instead of 1/sqrt(head_dim), planted where HeliumAttention's forward passes its scaling."""
    from transformers.models.helium import modeling_helium

    real = modeling_helium.eager_attention_forward

    def scaled_by_d_model(module, query, key, value, attention_mask, scaling, **kwargs):
        return real(module, query, key, value, attention_mask, scaling=module.config.hidden_size ** -0.5, **kwargs)

    monkeypatch.setattr(modeling_helium, "eager_attention_forward", scaled_by_d_model)
    rec = run_recorded("attn-check", [*SMALL, "impl=hf:helium", "checks=[masks,sdpa]"])
    assert "sdpa_match" in failed({c.check: c for c in rec.checks_rows})


# ------------------------------------------------------------------------- the supported version range
def test_installed_transformers_is_in_the_declared_range():
    assert in_range(installed_version()), (installed_version(), SUPPORTED)
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert f'hf = ["transformers{SUPPORTED}"]' in pyproject  # one range, declared in both places


@pytest.mark.parametrize("version", ["4.57.6", "6.0.0", "5.0.0rc1"])
def test_version_outside_the_range_exits_2_before_any_check(version, monkeypatch, tmp_path):
    """Only the version *reader* is replaced (the real out-of-range install is tested by scripts/test-hf-floor.sh
    through test_out_of_range_install_exits_2)."""
    from tfmoe.adapters import transformers_support

    monkeypatch.setattr(transformers_support, "installed_version", lambda: version)
    for args in (["attn-check", "impl=hf:llama", *SMALL], ["route-sim", "impl=hf:mixtral"]):
        res = run_cli(args, tmp_path)
        lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
        assert res.exit_code == 2 and len(lines) == 1 and SUPPORTED in lines[0] and version in lines[0], res.stderr


@pytest.mark.skipif(in_range(installed_version()), reason="needs a transformers outside the supported range "
                    "(scripts/test-hf-floor.sh installs one)")
def test_out_of_range_install_exits_2(tmp_path):
    res = run_cli(["attn-check", "impl=hf:llama", *SMALL], tmp_path)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and SUPPORTED in lines[0], res.stderr


# --------------------------------------------------------------------------------------------- the zoo
def zoo_module():
    sys.path.insert(0, str(SCRIPTS))
    try:
        import zoo_hf_attention
    finally:
        sys.path.remove(str(SCRIPTS))
    return zoo_hf_attention


KINDS = [("llama", "vetted", ""), ("cohere", "vetted", ""), ("gpt2", "vetted", ""), ("bert", "vetted", ""),
         ("qwen3", "refused", "q/k norm"), ("gemma2", "refused", "logit softcapping"),
         ("phi", "refused", "partial rotary"), ("phi3", "refused", "fused qkv"),
         ("granite", "refused", "non-standard scale"), ("cohere2", "refused", "NoPE / sliding-window-only RoPE"),
         ("gte", "vetted", ""), ("layoutlm", "vetted", ""), ("align_text_model", "vetted", ""),
         ("yoso", "refused", "approximate attention"), ("big_bird", "refused", "block-sparse attention"),
         ("roformer", "vetted", ""), ("bros", "refused", "position biases"),
         ("yolos", "refused", "no attention mask"), ("canine", "refused", "not a plain self-attention call"),
         ("eomt_dinov3", "refused", "2-D / multimodal RoPE"), ("xcodec2", "refused", "RoPE over heads"),
         ("ultrabert", "refused", "per-layer-type RoPE"), ("mimo_v2_flash", "refused", "attention sinks"),
         ("unlimited_ocr_text", "refused", "eager path without repeat_kv")]


@pytest.mark.parametrize(("model_type", "verdict", "kind"), KINDS, ids=[k[0] for k in KINDS])
def test_zoo_classifies_a_representative_set(model_type, verdict, kind):
    installed(model_type)
    z = zoo_module()
    entry = z.classify(model_type)
    assert entry.verdict == verdict, entry
    if verdict == "refused":
        assert z.refusal_kind(entry.reason) == kind, entry.reason


@pytest.mark.slow
def test_zoo_enumerates_every_self_attention_type_each_vetted_or_refused_by_name():
    z = zoo_module()
    types = z.attention_types()
    assert set(VETTED) & set(CONFIG_MAPPING) <= set(types)
    entries = [z.classify(t, a) for t, a in types.items()]
    assert {e.model_type for e in entries if e.verdict == "vetted"} == set(VETTED) & set(types)
    unnamed = [e for e in entries if e.verdict == "refused" and z.refusal_kind(e.reason) == "other"]
    assert not unnamed, unnamed


def test_zoo_script_writes_each_section_to_its_file_and_indexes_them_in_order(tmp_path, monkeypatch):
    """Each section's table goes to experiments/zoo/<name>.md; the report's generated block lists them in order with
    their counts; the hand-written report around the block is kept; --only rebuilds one section alone."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        import zoo
    finally:
        sys.path.remove(str(SCRIPTS))
    for name, title in (("zoo_moe", "MoE"), ("zoo_hf_attention", "HF")):
        (tmp_path / f"{name}.py").write_text(f"TITLE = {title!r}\n\ndef section():\n"
                                             f"    return '{title} table', {{'passes': 2}}\n")
    report = tmp_path / "zoo.md"
    report.write_text(f"# Report\n\nby hand\n\n{zoo.BEGIN}\nold\n{zoo.END}\n\n## Limits\n", encoding="utf-8")
    monkeypatch.setattr(zoo, "SCRIPTS", tmp_path)
    monkeypatch.setattr(zoo, "TABLES", tmp_path / "zoo")
    monkeypatch.setattr(zoo, "REPORT", report)
    for name in ("zoo_moe", "zoo_hf_attention"):
        sys.modules.pop(name, None)
    try:
        assert zoo.main([]) == 0
        text = report.read_text(encoding="utf-8")
        assert text.startswith("# Report\n\nby hand\n") and text.endswith("## Limits\n") and "old" not in text
        assert text.index("| HF | passes 2 |") < text.index("| MoE | passes 2 |")
        assert "| zoo_libraries | not generated yet |" in text and "[zoo/hf-attention.md](zoo/hf-attention.md)" in text
        assert "HF table" in (tmp_path / "zoo" / "hf-attention.md").read_text(encoding="utf-8")
        (tmp_path / "zoo_moe.py").write_text("TITLE = 'MoE'\n\ndef section():\n    return 'new', {'passes': 3}\n")
        sys.modules.pop("zoo_moe", None)
        before = (tmp_path / "zoo" / "hf-attention.md").read_text(encoding="utf-8")
        assert zoo.main(["--only", "zoo_moe"]) == 0
        assert (tmp_path / "zoo" / "hf-attention.md").read_text(encoding="utf-8") == before
        assert "| MoE | passes 3 |" in report.read_text(encoding="utf-8")
    finally:
        for name in ("zoo_moe", "zoo_hf_attention"):
            sys.modules.pop(name, None)
