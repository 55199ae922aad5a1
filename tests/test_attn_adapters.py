"""attn-check on real attention layers through adapters: nn.MultiheadAttention, Hugging Face transformers' layers
(built from tiny configs, nothing downloaded), a user's layer in another layout, and a user's module in the cwd."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
from test_attn_check import FAST, failed

from tfmoe.api.testing import run_cli, run_recorded
from tfmoe.contract.errors import BadInput

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TESTS = Path(__file__).resolve().parent
# Tiny cases (D=16, 4 heads, T=6): each battery takes about a second; the chunked probe is the only big tensor.
SMALL = ["d_model=16", "n_heads=4", "T=6", *FAST]


def battery(*overrides: str):
    rec = run_recorded("attn-check", [*SMALL, *overrides])
    return {c.check: c for c in rec.checks_rows}, rec


def hf():
    return pytest.importorskip("transformers", reason="the `hf` extra (transformers 5.x) is not installed")


# ------------------------------------------------------------------------------- correct layers pass
def test_torch_mha_passes_with_its_declared_fully_masked_policy():
    checks, rec = battery("impl=torch:mha", "fully_masked_policy=nan")
    assert failed(checks) == set(), {n: checks[n].detail for n in failed(checks)}
    assert {"sdpa_match", "grad_match", "gradcheck", "row_sums", "causal_zero", "padding_zero", "head_counts",
            "dropout_rate", "dropout_scale"} <= set(checks)
    assert any("module -> nan" in n for n in rec.notes)


def test_torch_mha_nan_rows_fail_the_default_policy_with_the_fix_named():
    """nn.MultiheadAttention gives NaN for a query that sees no key, and the NaN reaches the gradients of a loss
    over the other rows: the default policy (finite) fails, and the detail says what to do."""
    checks, _ = battery("impl=torch:mha", "checks=[fully_masked]")
    detail = checks["fully_masked_rows"].detail
    assert not checks["fully_masked_rows"].passed and "nan" in detail and "fully_masked_policy=nan" in detail


HF_CORRECT = [("hf:llama", []), ("hf:mistral", ["n_kv_heads=2"]), ("hf:qwen2", ["n_kv_heads=1"]),
              ("hf:gpt2", []), ("hf:bert", ["causal=false"])]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize(("spec", "extra"), HF_CORRECT, ids=[s for s, _ in HF_CORRECT])
def test_hugging_face_layers_pass(spec, extra, attn):
    hf()
    checks, rec = battery(f"impl={spec}", f"hf.attn_implementation={attn}", "checks=[masks,sdpa,gradients,invariances]",
                          *extra)
    assert failed(checks) == set(), {n: checks[n].detail for n in failed(checks)}
    assert "sdpa_match" in checks and "grad_match" in checks
    weight_checks = {"row_sums", "causal_zero", "padding_zero"} & set(checks)
    if attn == "eager":
        assert "row_sums" in weight_checks
    else:  # sdpa returns no weights: those checks are n/a rows (tfmoe.rules.capabilities), never failed
        assert "row_sums" in weight_checks and all(checks[n].outcome == "n/a" for n in weight_checks)
        assert "attention_weights" in checks["row_sums"].detail


def test_qwen2_biases_and_gqa_reach_the_reference():
    hf()
    _, rec = battery("impl=hf:qwen2", "n_kv_heads=2", "checks=[sdpa]")
    saved = rec.tensors_saved
    assert {"b_q", "b_k", "b_v"} <= set(saved) and "b_o" not in saved  # qwen2: q/k/v biases, no o bias
    assert tuple(saved["w_qkv"].shape) == (16 + 2 * 8, 16)  # q (16) + k, v (2 kv heads x Dh 4 each)


def test_whole_battery_on_hf_llama_and_a_user_adapter():
    hf()
    for spec in ("impl=hf:llama", "impl=adapted_attention:EinsumAdapter"):
        checks, _ = battery(spec)
        assert failed(checks) == set(), (spec, {n: checks[n].detail for n in failed(checks)})


def test_hf_eager_computes_in_float32_named_in_fp64():
    """transformers' eager attention takes the softmax with dtype=float32 and builds cos/sin in fp32: in an fp64
    run sdpa_match fails and names float32 as the cause; fp32 runs are judged normally (no gradcheck false alarm)."""
    hf()
    checks, _ = battery("impl=hf:llama", "dtype=fp64", "checks=[sdpa]")
    assert not checks["sdpa_match"].passed and "computes in float32" in checks["sdpa_match"].detail


# --------------------------------------------------------------- bugs planted inside transformers' own code
def test_bug_in_transformers_rotary_is_caught(monkeypatch):
    hf()
    from transformers.models.llama import modeling_llama

    def rotary_wrong_sign(q, k, cos, sin, unsqueeze_dim=1):
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return q * cos - modeling_llama.rotate_half(q) * sin, k * cos - modeling_llama.rotate_half(k) * sin

    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", rotary_wrong_sign)
    checks, rec = battery("impl=hf:llama", "checks=[sdpa,gradients]")
    # only sdpa_match: the wrong forward hides HF's fp32 softmax from the precision probe, and gradcheck's
    # fine-step failure (rounding) is recognised by its agreement at a coarse step instead of being blamed
    assert failed(checks) == {"sdpa_match", "left_padding_match"}, {n: checks[n].detail for n in failed(checks)}
    assert any("gradcheck not judged" in n for n in rec.notes)


def test_bug_in_transformers_repeat_kv_is_caught(monkeypatch):
    hf()
    from transformers.models.llama import modeling_llama

    def repeat_kv_tiled(hidden, n_rep):  # kv heads 0,1,0,1 instead of 0,0,1,1
        return hidden if n_rep == 1 else hidden.repeat(1, n_rep, 1, 1)

    monkeypatch.setattr(modeling_llama, "repeat_kv", repeat_kv_tiled)
    checks, _ = battery("impl=hf:llama", "n_kv_heads=2", "checks=[sdpa]")
    assert not checks["sdpa_match"].passed


def test_bug_in_transformers_mask_builder_is_caught(monkeypatch):
    hf()
    from transformers import masking_utils

    def sees_the_next_key(batch_idx, head_idx, q_idx, kv_idx):
        return kv_idx <= q_idx + 1

    monkeypatch.setattr(masking_utils, "causal_mask_function", sees_the_next_key)
    checks, _ = battery("impl=hf:llama", "checks=[masks,sdpa]")
    assert not checks["causal_zero"].passed and not checks["sdpa_match"].passed


def test_hf_eager_and_sdpa_disagree_without_a_mask():
    """A finding about transformers itself (see experiments/attn-check.md): called with attention_mask=None,
    LlamaAttention is bidirectional under eager but causal under sdpa (sdpa_attention_forward sets is_causal from
    the module's is_causal=True when no mask is given). The adapter therefore always passes the model's mask."""
    hf()
    from tfmoe.adapters.huggingface import HuggingFace

    torch.manual_seed(0)
    outs = {}
    for impl in ("eager", "sdpa"):
        adapter = HuggingFace("llama", impl)
        torch.manual_seed(0)
        m = adapter.build(16, 4, n_kv_heads=4, causal=True, dropout=0.0, seed=0, dtype=torch.float32,
                          device=torch.device("cpu"))
        x = torch.randn(1, 5, 16, generator=torch.Generator().manual_seed(1))
        pos = torch.arange(5)[None]
        outs[impl] = m(x, position_embeddings=m._tfmoe_rotary(x, pos), attention_mask=None)[0]
    last = (outs["eager"][:, -1] - outs["sdpa"][:, -1]).abs().max()  # the last query sees every key either way
    first = (outs["eager"][:, 0] - outs["sdpa"][:, 0]).abs().max()  # the first sees only itself under sdpa
    assert last < 1e-5 and first > 1e-3


# ------------------------------------------------------------------------ a user's layer, another layout
def test_user_adapter_catches_a_bug_in_its_layer():
    # causal + right padding: the bug's only effect is on padded query rows, don't-care unless required
    checks, _ = battery("impl=adapted_attention:BuggyEinsumAdapter", "checks=[sdpa,fully_masked]",
                        "padded_query_policy=attend")
    assert failed(checks) == {"sdpa_match", "left_padding_match"}
    checks, _ = battery("impl=adapted_attention:BuggyEinsumAdapter", "checks=[sdpa,fully_masked]", "causal=false")
    assert failed(checks) == {"sdpa_match", "left_padding_match"}  # real queries see the padded keys
    checks, _ = battery("impl=adapted_attention:BuggyEinsumAdapter", "checks=[sdpa]")  # the defaults: left padding
    assert failed(checks) == {"left_padding_match"}


def test_user_module_in_the_current_directory_needs_no_pythonpath(tmp_path, monkeypatch):
    """Issue 13: a correct my_attn.py in the cwd gave `cannot import 'my_attn'` until PYTHONPATH=. was set."""
    shutil.copy(TESTS / "buggy_attention.py", tmp_path / "my_attn.py")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if Path(p or ".").resolve() != TESTS])
    sys.modules.pop("my_attn", None)
    res = run_cli(["attn-check", "impl=my_attn:PlainMHA", *SMALL, "checks=sdpa"], tmp_path)
    assert res.exit_code == 0, res.stdout + res.stderr
    sys.modules.pop("my_attn", None)


def test_cli_runs_hf_llama_sdpa_exit_0(tmp_path):
    hf()
    from tfmoe.harness.store.notebook import load_run

    res = run_cli(["attn-check", "impl=hf:llama", "hf.attn_implementation=sdpa", *SMALL], tmp_path)
    assert res.exit_code == 0, res.stdout + res.stderr
    checks = load_run(res.run_dir).checks
    assert checks["passed"].all() and "sdpa_match" in set(checks["check"])
    assert checks.set_index("check").loc["row_sums", "detail"].startswith("not applicable")  # no weights: n/a


# ------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(("overrides", "fragment"), [
    (["impl=torch:flex"], "unknown SPEC torch:flex"),
    (["impl=hf:"], "name a model type"),
    (["impl=hf:no_such_model"], "unknown model type 'no_such_model'"),
    (["impl=hf:gemma2"], "attn_logit_softcapping"),
    (["impl=hf:qwen3"], "q_norm"),
    (["impl=hf:llama", "causal=false"], "pass causal=true"),
    (["impl=hf:llama", "n_kv_heads=3"], "does not divide"),
    (["impl=hf:llama", "hf.attn_implementation=flash"], "hf.attn_implementation"),
    (["impl=torch:mha", "n_kv_heads=2"], "n_kv_heads"),
    (["impl=buggy_attention:NoPaddingArg"], "padding_mask"),
    (["impl=buggy_attention:NoQkvLayer"], "needs `qkv`"),
    (["fully_masked_policy=random"], "fully_masked_policy"),
])
def test_bad_input_is_one_line(overrides, fragment):
    if any(o.startswith("impl=hf:") and o != "impl=hf:" for o in overrides):
        hf()
    with pytest.raises(BadInput, match=fragment) as err:
        run_recorded("attn-check", [*SMALL, *overrides])
    assert "\n" not in str(err.value)


def test_missing_hf_extra_names_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    res = run_cli(["attn-check", "impl=hf:llama"], tmp_path)
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and "extra `hf`" in lines[0], res.stderr
