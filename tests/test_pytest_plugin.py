"""tfmoe's pytest plugin, run for real by pytest's own pytester (issue 31): the example test file the docs ship
passes on its correct layer and fails, with the table, when one bug is planted in it; --tfmoe-record keeps the
failed checks' run directories; --tfmoe-profile reaches every call; a misused marker is one line."""

from __future__ import annotations

import importlib.metadata
import shutil
from pathlib import Path

import pytest
import torch  # noqa: F401  pytester's inline runs drop the modules they import; torch cannot load twice

import tfmoe
import tfmoe.api.checking  # noqa: F401  the batteries too stay loaded across inline runs

pytest_plugins = ["pytester"]

EXAMPLES = Path(__file__).resolve().parents[1] / "docs" / "examples"


def plugin_args() -> list[str]:
    """-p tfmoe.api.pytest_plugin unless the installed distribution's pytest11 entry point already loads it."""
    installed = any(ep.value == "tfmoe.api.pytest_plugin" for ep in importlib.metadata.entry_points(group="pytest11"))
    return [] if installed else ["-p", "tfmoe.api.pytest_plugin"]


def copy_examples(pytester: pytest.Pytester) -> Path:
    for name in ("my_attention.py", "test_my_attention.py"):
        shutil.copy(EXAMPLES / name, pytester.path / name)
    return pytester.path / "my_attention.py"


def test_the_shipped_example_passes_and_a_planted_bug_fails_it(pytester: pytest.Pytester, tmp_path: Path) -> None:
    layer = copy_examples(pytester)
    result = pytester.runpytest(*plugin_args(), "-p", "no:cacheprovider")
    result.assert_outcomes(passed=4)

    text = layer.read_text()
    planted = text.replace("/ math.sqrt(self.d_head)", "/ math.sqrt(D)")  # scale by d_model, not d_head
    assert planted != text
    layer.write_text(planted)
    shutil.rmtree(pytester.path / "__pycache__", ignore_errors=True)
    record = tmp_path / "kept"
    # the quick battery's failure is test_checks' (it costs ~10 s): here the marker, the fixture and the verdict
    result = pytester.runpytest(*plugin_args(), "-p", "no:cacheprovider", f"--tfmoe-record={record}",
                                "-k", "not test_my_attention_conforms")
    result.assert_outcomes(failed=3)
    out = result.stdout.str()
    assert "sdpa_match" in out and "check(s) failed" in out
    assert "likely cause (inferred, not proven)" in out
    kept = sorted((record / "attn-check").iterdir())
    assert len(kept) == 2  # the fixture's failed check keeps a run directory; so does the marker's
    for run_dir in kept:
        assert tfmoe.load_run(run_dir).run["status"] == "failed"


def test_the_profile_reaches_every_call(pytester: pytest.Pytester) -> None:
    copy_examples(pytester)
    pytester.makepyfile(test_profile="""
        from my_attention import MyAttention

        def test_profile(tfmoe_check):
            verdict = tfmoe_check.check_attention(MyAttention, checks=["sdpa"])
            print("SAMPLES", verdict.settings.get("dropout_samples"))
    """)
    quick = pytester.runpytest(*plugin_args(), "-p", "no:cacheprovider", "-s", "test_profile.py")
    quick.assert_outcomes(passed=1)
    assert "SAMPLES 25281" in quick.stdout.str()
    full = pytester.runpytest(*plugin_args(), "-p", "no:cacheprovider", "-s", "--tfmoe-profile=full",
                              "test_profile.py")
    full.assert_outcomes(passed=1)
    assert "SAMPLES None" in full.stdout.str()


def test_a_misused_marker_is_one_line(pytester: pytest.Pytester) -> None:
    copy_examples(pytester)
    pytester.makepyfile(test_misused="""
        import pytest
        from my_attention import MyAttention

        @pytest.mark.tfmoe_attention(MyAttention, MyAttention)
        def test_two_layers():
            pass

        @pytest.mark.tfmoe_attention(MyAttention, heads=2)
        def test_unknown_key():
            pass
    """)
    result = pytester.runpytest(*plugin_args(), "-p", "no:cacheprovider", "test_misused.py")
    result.assert_outcomes(failed=2)
    out = result.stdout.str()
    assert "takes one layer and keyword settings, got 2" in out
    assert "@pytest.mark.tfmoe_attention: unknown setting 'heads' for attn-check" in out


def test_the_docs_show_the_shipped_example() -> None:
    """docs/checking-your-own-layers.md shows the example's tests as the file has them (the file is what runs)."""
    docs = (EXAMPLES.parent / "checking-your-own-layers.md").read_text(encoding="utf-8")
    block = docs.split("# test_my_attention.py", 1)[1].split("```", 1)[0]
    start = "def test_my_attention_conforms"
    shipped = (EXAMPLES / "test_my_attention.py").read_text(encoding="utf-8")
    assert block[block.index(start):].strip() == shipped[shipped.index(start):].strip()


def test_a_misspelled_tfmoe_marker_fails_the_test(pytester: pytest.Pytester) -> None:
    copy_examples(pytester)
    pytester.makepyfile(test_typo="""
        import pytest
        from my_attention import MyAttention

        @pytest.mark.tfmoe_attentoin(MyAttention, profile="quick")
        def test_typo():
            pass

        @pytest.mark.other_marker
        def test_not_ours():
            pass
    """)
    result = pytester.runpytest(*plugin_args(), "-p", "no:cacheprovider", "test_typo.py")
    result.assert_outcomes(failed=1, passed=1)
    assert "unknown marker @pytest.mark.tfmoe_attentoin: tfmoe's markers are tfmoe_attention" in result.stdout.str()
