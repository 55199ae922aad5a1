"""The model battery (decode / shift-labels / arch ``impl=``) on whole causal LMs: correct models written different
ways pass, each planted bug (tests/planted_models.py) fails the experiment where its claim lives under the defaults
with its likely cause named, lacked features are n/a (and exit 2 where the main setting needs them), a
batch-dependent design is stated, and Hugging Face's families pass. The default suite runs each planted bug through
its own experiment only; the whole cross-product and the HF families are marked slow."""

from __future__ import annotations

from pathlib import Path

import planted_models
import pytest
import torch

import tfmoe
from tfmoe.adapters.causal_lm import CausalLMAdapter, LMOutput
from tfmoe.api import checking as checks
from tfmoe.api.testing import run_cli
from tfmoe.experiments.lm_battery import lm_labels, positions
from tfmoe.harness.store.notebook import load_run

QUICK = {"profile": "quick"}
pytest_plugins = ["pytester"]

# planted bug -> the checks that must fail under the defaults (in the experiment where its claim lives)
EXPECTED = {
    "PositionsIgnoreIds": ("arch", {"arch:lm.left_pad_positions"}),
    "NoCausalMaskWithCache": ("arch", {"arch:lm.causal_cached"}),
    "PaddingOnQueriesNotKeys": ("shift-labels", {"shift-labels:lm.batch_invariance.left",
                                                 "shift-labels:lm.padding_content"}),
    "LossNotShifted": ("shift-labels", {"shift-labels:lm.loss_matches_shifted_ce"}),
    "LossCountsPadding": ("shift-labels", {"shift-labels:lm.loss_matches_shifted_ce"}),
    "CacheForgetsPastMask": ("decode", {"decode:lm.kv_cache_teacher_forcing"}),
    "RopeOffByOneInStep": ("decode", {"decode:lm.kv_cache_teacher_forcing"}),
    "CacheKeepsLastN": ("decode", {"decode:lm.kv_cache_teacher_forcing"}),
}


def test_every_planted_model_has_an_expectation() -> None:
    assert set(EXPECTED) == set(planted_models.PLANTED)
    assert all(planted_models.PLANTED[n] == exp for n, (exp, _) in EXPECTED.items())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_planted_bug_fails_where_its_claim_lives(name: str) -> None:
    experiment, must_fail = EXPECTED[name]
    verdict = checks.check_model(getattr(planted_models, name), experiments=(experiment,), **QUICK)
    failed = {c.name for c in verdict.failed}
    assert must_fail <= failed, verdict.table()
    assert any(f"planted_models.{name}" in cause for cause in verdict.likely_causes), verdict.table()


@pytest.mark.parametrize("name", ["AbsoluteTupleCache", "RotaryObjectCache"])
def test_correct_models_written_two_ways_pass(name: str) -> None:
    verdict = checks.check_model(getattr(planted_models, name), **QUICK)
    assert verdict.passed, verdict.table()
    assert not [c for c in verdict.checks if c.outcome == "n/a"], verdict.table()
    assert verdict["decode:lm.generation_batch_vs_alone"].observed == 0


def test_a_model_without_mask_cache_or_loss_is_judged_where_it_can_be() -> None:
    with pytest.raises(checks.BadSettings, match=r"lacks kv_cache .*lm.use_cache=false"):
        checks.check_model(planted_models.NoMaskLM, experiments=("decode",), **QUICK)
    verdict = checks.check_model(planted_models.NoMaskLM, lm={"use_cache": False}, **QUICK)
    assert verdict.passed, verdict.table()
    na = {c.name for c in verdict.checks if c.outcome == "n/a"}
    assert {"arch:lm.causal_cached", "arch:lm.left_pad_positions", "shift-labels:lm.batch_invariance.left",
            "shift-labels:lm.loss_matches_shifted_ce", "decode:lm.kv_cache_teacher_forcing"} <= na
    assert "no attention_mask parameter" in verdict["arch:lm.left_pad_positions"].detail
    assert verdict["arch:lm.causal"].outcome == "passed"
    # what can be judged without a mask is: greedy generation of equal-length prompts, batched vs alone
    assert verdict["decode:lm.generation_batch_vs_alone"].outcome == "passed"
    assert "equal lengths" in verdict["decode:lm.generation_batch_vs_alone"].detail


def test_a_model_instance_is_judged_as_built() -> None:
    model = planted_models.RotaryObjectCache()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    verdict = checks.check_model(model, experiments=("arch",), **QUICK)
    assert verdict.passed and verdict["arch:lm.causal_cached"].outcome == "passed", verdict.table()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # its weights untouched


def test_a_declared_lack_is_read_and_an_unknown_one_refused() -> None:
    verdict = checks.check_model(planted_models.AbsoluteTupleCache, experiments=("shift-labels",), lacks=["loss"],
                                 **QUICK)
    assert verdict["shift-labels:lm.loss_matches_shifted_ce"].outcome == "n/a"
    assert "config's lacks=" in verdict["shift-labels:lm.loss_matches_shifted_ce"].detail
    with pytest.raises(checks.BadSettings, match="unknown feature"):
        checks.check_model(planted_models.AbsoluteTupleCache, experiments=("arch",), lacks=["wings"], **QUICK)


@pytest.mark.parametrize(("settings", "match"), [
    ({"lm": {"steps": 0}}, "lm.steps"),
    ({"lm": {"steps": 5000}}, r"lm.steps <= 4083"),
    ({"lm": {"tol_eps": -1.0}}, "lm.tol_eps"),
    ({"nonsense": 1}, "unknown setting"),
    ({"experiments": ("train",)}, "experiments="),
])
def test_bad_settings_are_one_line(settings: dict, match: str) -> None:
    with pytest.raises(checks.BadSettings, match=match):
        checks.check_model(planted_models.AbsoluteTupleCache, **{"experiments": ("decode",), **settings})


@pytest.mark.parametrize(("spec", "match"), [
    ("planted_models:Nope", "has no 'Nope'"),
    ("hf:bert", "no tiny config for model type 'bert'"),
    ("planted_models:VOCAB", "not a model class"),
])
def test_bad_impl_exits_2_with_one_line(spec: str, match: str, tmp_path: Path) -> None:
    result = run_cli(["arch", f"impl={spec}"], tmp_path)
    assert result.exit_code == 2, result.stdout + result.stderr
    assert match in " ".join(result.stderr.split())
    assert "Traceback" not in result.stderr


def test_the_users_exception_fails_the_check_and_leads_its_detail() -> None:
    class Raising(planted_models.AbsoluteTupleCache):
        def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None,  # type: ignore
                    use_cache=False, labels=None):
            if input_ids.shape[1] == 1 and past_key_values is not None:
                raise RuntimeError("step broke")
            return super().forward(input_ids, attention_mask, position_ids, past_key_values, use_cache, labels)

    verdict = checks.check_model(Raising, experiments=("decode",), **QUICK)
    row = verdict["decode:lm.kv_cache_teacher_forcing"]
    assert row.outcome == "failed" and row.detail.startswith("raised RuntimeError: step broke")


def test_an_adapter_drives_another_layout() -> None:
    class NanoAdapter(CausalLMAdapter):
        lacks = ("padding_mask", "kv_cache", "position_ids")

        def build(self, seed: int) -> torch.nn.Module:
            return planted_models.NoMaskLM()

        def forward(self, model, input_ids, attention_mask, position_ids, past, use_cache, labels):  # type: ignore
            logits = model(input_ids)
            loss = None
            if labels is not None:  # nanoGPT takes shifted targets
                loss = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:])
            return LMOutput(logits, None, loss)

    verdict = checks.check_model(NanoAdapter(), lm={"use_cache": False}, **QUICK)
    assert verdict.passed, verdict.table()
    assert verdict["shift-labels:lm.loss_matches_shifted_ce"].outcome == "passed"
    assert "each sequence alone" in verdict["shift-labels:lm.loss_matches_shifted_ce"].detail


def test_a_model_written_for_autocast_is_judged_under_autocast() -> None:
    verdict = checks.check_model(planted_models.Fp32Island, experiments=("decode",), **QUICK)
    assert verdict.passed, verdict.table()
    for p in ("fp16", "bf16"):
        assert f"torch.autocast({p})" in verdict[f"decode:lm.low_precision.{p}"].detail


class TupleLM(planted_models.NoMaskLM):
    """nanoGPT's forward(idx, targets=None) -> (logits, loss)."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):  # type: ignore[override]
        return super().forward(idx), None


def test_nanogpts_logits_loss_tuple_is_read_as_logits() -> None:
    verdict = checks.check_model(TupleLM, experiments=("arch",), **QUICK)
    assert verdict["arch:lm.causal"].outcome == "passed", verdict.table()


def test_labels_and_positions_follow_the_mask() -> None:
    ids = torch.tensor([[0, 0, 5, 6, 7], [5, 6, 7, 8, 9]])
    mask = (ids != 0).long()
    assert positions(mask).tolist() == [[1, 1, 0, 1, 2], [0, 1, 2, 3, 4]]
    # the first real token of a left-padded row is no target: its input is a pad
    assert lm_labels(ids, mask).tolist() == [[-100, -100, -100, 6, 7], [-100, 6, 7, 8, 9]]


def test_the_learners_view_on_the_users_model(tmp_path: Path) -> None:
    (tmp_path / "planted_models.py").write_text(Path(planted_models.__file__).read_text())
    result = run_cli(["shift-labels", "impl=planted_models:PaddingOnQueriesNotKeys", "pad_side=left"], tmp_path)
    assert result.exit_code == 1, result.stdout + result.stderr
    run = load_run(result.run_dir)
    summary = (result.run_dir / "summary.md").read_text()
    assert "## Your model, position by position" in summary and "| NO" in summary
    assert (result.run_dir / "lm_batch_vs_alone.png").exists()
    gap = tfmoe.load_tensor(result.run_dir, "lm.per_position_gap")
    assert gap.shape == (3, 5) and float(gap.max()) > 0
    assert run.run["status"] == "failed"


def test_the_tfmoe_model_marker_and_fixture(pytester: pytest.Pytester) -> None:
    import importlib.metadata
    import shutil

    shutil.copy(planted_models.__file__, pytester.path / "planted_models.py")
    pytester.makepyfile(test_my_lm="""
        import pytest
        import planted_models

        @pytest.mark.tfmoe_model(planted_models.PaddingOnQueriesNotKeys, experiments=["shift-labels"])
        def test_planted():
            pass

        @pytest.mark.tfmoe_model(planted_models.AbsoluteTupleCache, experiments=["arch"])
        def test_correct():
            pass

        def test_fixture(tfmoe_check):
            assert tfmoe_check.check_model(planted_models.RotaryObjectCache, experiments=["arch"]).passed
    """)
    installed = any(ep.value == "tfmoe.api.pytest_plugin" for ep in importlib.metadata.entry_points(group="pytest11"))
    # in a subprocess: an inline run leaves modules behind that break later tests of the session (pandas indexes)
    result = pytester.runpytest_subprocess(*([] if installed else ["-p", "tfmoe.api.pytest_plugin"]),
                                           "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=1)
    out = result.stdout.str()
    assert "lm.padding_content" in out and "planted_models.PaddingOnQueriesNotKeys" in out


def test_hf_outputs_are_read_by_their_current_field_names(capfd: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    import logging

    logging.Logger.warning_once.cache_clear()  # type: ignore[attr-defined]  # transformers warns once per process
    verdict = checks.check_model("hf:gpt2", experiments=("arch",), **QUICK)
    assert verdict.passed, verdict.table()
    assert verdict["arch:lm.causal_cached"].outcome == "passed"  # the cache was found and used
    assert "deprecated" not in capfd.readouterr().err


# --------------------------------------------------------------------------------------------- slow
@pytest.mark.slow
def test_a_batch_dependent_design_is_stated_not_failed_nor_passed() -> None:
    verdict = checks.check_model(planted_models.CapacityMoELM, **QUICK)
    assert verdict.passed, verdict.table()
    stated = [c for c in verdict.checks if c.outcome == "n/a" and "by design" in c.detail]
    assert stated and all("capacity_factor=1" in c.detail and "measured max |Δ|" in c.detail
                          or "greedy" in c.detail for c in stated)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_planted_bug_through_all_three(name: str) -> None:
    verdict = checks.check_model(getattr(planted_models, name), **QUICK)
    assert EXPECTED[name][1] <= {c.name for c in verdict.failed}, verdict.table()


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["lm_libraries:nano_gpt_tiny", "lm_libraries:palm_tiny",
                                  "lm_libraries:XTransformersRotary", "lm_libraries:XTransformersAbsolute"])
def test_public_libraries_pass_on_first_contact(spec: str) -> None:
    lib = {"nano": "nano_gpt", "palm": "palm_pytorch", "XTra": "x_transformers"}[spec.split(":")[1][:4]]
    pytest.importorskip(lib)
    settings = {"lm": {"use_cache": False}} if "tiny" in spec else {}  # no cache in nano-gpt or PaLM
    verdict = checks.check_model(spec, **settings)
    assert verdict.passed, verdict.table()


@pytest.mark.slow
@pytest.mark.parametrize("spec", ["hf:gpt2", "hf:llama", "hf:qwen2", "hf:mistral", "hf:qwen2_moe", "hf:mixtral"])
def test_hugging_face_families_pass(spec: str) -> None:
    pytest.importorskip("transformers")
    verdict = checks.check_model(spec)
    assert verdict.passed, verdict.table()
    assert not [c for c in verdict.checks if c.outcome == "n/a"], verdict.table()
