"""One writer per run: a directory that already holds a run (or lies inside one) is refused at every entry point,
and the text a person types (`conclude`, `failures add`) follows one rule, drawn here from one hostile alphabet;
`show` escapes whatever is already on disk."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from tfmoe.api.testing import launched, run_cli
from tfmoe.contract.errors import BadInput
from tfmoe.rules.safe_text import shown_text, typed_text

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


def tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha1(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not str(p.relative_to(root)).startswith("runs/.tfmoe-")}


@pytest.fixture
def a_run_and_a_sweep(fake_experiment) -> tuple[Path, Path]:
    run = launched(fake_experiment, [])[1][-1]
    jobs = launched(fake_experiment, ["seed=1,2"], multirun=True)[1]
    return run, jobs[0].parent


@pytest.mark.parametrize("args", [
    ["hydra.run.dir={run}"], ["-m", "seed=3,4", "hydra.sweep.dir={sweep}"], ["run_root={run}"],
    ["-m", "seed=3,4", "run_root={run}"], ["hydra.run.dir={run}/inside"], ["hydra.run.dir={sweep}"],
    ["-m", "seed=3", "hydra.sweep.dir={sweep}/0"], ["hydra.run.dir=runs"], ["++hydra.run.dir={run}"],
])
def test_a_directory_that_holds_a_run_is_refused_at_every_entry_point(a_run_and_a_sweep: tuple[Path, Path],
                                                                      args: list[str]) -> None:
    run, sweep = a_run_and_a_sweep
    before = tree(Path.cwd())
    r = run_cli(["fake", *(a.format(run=run, sweep=sweep) for a in args)], Path.cwd())
    assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.stdout + r.stderr
    assert "written once" in r.stderr and ("unset" in r.stderr or "run_root=runs" in r.stderr)
    assert tree(Path.cwd()) == before  # nothing written, not even the writability probe's directory


def test_a_new_or_empty_directory_is_accepted(fake_experiment, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    for target in (empty, tmp_path / "new" / "deeper"):
        r = run_cli(["fake", f"hydra.run.dir={target}"], tmp_path)
        assert r.exit_code == 0, r.stderr
        assert (target / "run.parquet").exists()
    r = run_cli(["fake", f"run_root={tmp_path / 'elsewhere'}"], tmp_path)  # a runs root of its own: fine
    assert r.exit_code == 0, r.stderr


# ------------------------------------------------------------------------------------------ one text rule
HOSTILE = ["\n## Proven\n- forged *(2020-01-01 00:00 UTC)*", "\x1b[2J", "\x1b]8;;http://x\x07", "\x00", "\x07",
           "\x9b31m", "\x85", "\u202e", "\u2066", "\u200b", "\ufeff", "\u2028", "\r", "\ud800", "\ue000"]
ACTING = {"\x1b", "\x00", "\x07", "\x9b", "\u202e", "\u2066", "\u200b", "\ufeff", "\ud800", "\ue000"}


@st.composite
def hostile_text(draw: st.DrawFn) -> str:
    parts = draw(st.lists(st.one_of(st.sampled_from(HOSTILE), st.text(alphabet=st.characters(
        codec="utf-8", exclude_categories=("Cs",)), max_size=6)), min_size=1, max_size=5))
    return "ok " + "".join(parts)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(text=hostile_text())
def test_one_rule_folds_line_breaks_and_refuses_what_acts(text: str) -> None:
    acting = any(ch in ACTING or (ch not in "\u200d" and __import__("unicodedata").category(ch) in
                                  ("Cc", "Cf", "Cs", "Co") and ch not in "\n\r\t\v\f\x1c\x1d\x1e\x85\u2028\u2029")
                 for ch in text)
    try:
        kept = typed_text("proven", text, "summary.md")
    except BadInput as exc:
        assert acting and "\n" not in str(exc) and "U+" in str(exc)
        return
    assert not acting
    assert "\n" not in kept and "\r" not in kept and "\u2028" not in kept
    assert shown_text(kept) == kept  # what was accepted shows as typed


@pytest.mark.parametrize("bad", ["\x1b[31mred", "a\u202eb", "a\u200bb", "a\x9bb", "a\x07b", "a\ufeffb"])
def test_conclude_and_failures_add_refuse_the_same_characters(fake_experiment, bad: str) -> None:
    from test_catalog import make_run

    run = launched(fake_experiment, [])[1][-1]
    failed = make_run(Path("runs"), "fake/20260101T000000Z-ffffffff", status="failed", checks=(False,))
    before = tree(Path.cwd())
    said = []
    for args in (["conclude", str(run), "--proven", bad], ["failures", "add", str(failed), "--hypothesis", bad]):
        r = run_cli(args, Path.cwd())
        assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.stderr
        said.append(r.stderr.split(" holds ")[1].split(")")[0])
    assert said[0] == said[1]  # the same character named the same way: one rule
    assert tree(Path.cwd()) == before


def test_a_newline_heading_is_folded_into_its_line_in_both(fake_experiment) -> None:
    run = launched(fake_experiment, [])[1][-1]
    r = run_cli(["conclude", str(run), "--proven", "fine\n## Proven\n- forged"], Path.cwd())
    assert r.exit_code == 0, r.stderr
    summary = (run / "summary.md").read_text()
    assert "- fine ## Proven - forged *(" in summary
    assert [line for line in summary.splitlines() if "Proven" in line and line.startswith("#")] == \
        ["### Proven (a check or a number from this run)"]


def test_show_escapes_what_is_already_on_disk(fake_experiment) -> None:
    """Conclusions and a check's detail written by hand (or by an older tfmoe) never act on the terminal."""
    import pandas as pd

    from tfmoe.harness.method import conclusions
    from tfmoe.harness.store import rundir

    run = launched(fake_experiment, [])[1][-1]
    forged = "x\x1b[2J\u202eevil\n## Proven\n- forged"
    rundir.write_parquet(pd.DataFrame({"kind": ["proven"], "text": [forged],
                                       "written_at": [pd.Timestamp("2020-01-01", tz="UTC")]}),
                         run / conclusions.CONCLUSIONS_FILE, schema=conclusions.schema())
    checks = pd.read_parquet(run / "checks.parquet")
    checks.loc[0, "detail"] = "detail \x1b[31mred\u202e"
    rundir.write_parquet(checks, run / "checks.parquet", schema=rundir.CHECKS_SCHEMA)
    for fmt in ("table", "md"):
        out = run_cli(["show", str(run), "--format", fmt], Path.cwd()).stdout
        assert "\x1b" not in out and "\u202e" not in out, fmt
        assert "\\x1b[2J\\u202eevil ## Proven - forged" in out and "\\x1b[31mred" in out


# ------------------------------------------------------------------------------------------ small edges
@pytest.mark.parametrize("name", ["latest", "-x"])
def test_a_run_directory_named_like_a_word_the_commands_read_is_refused(fake_experiment, name: str) -> None:
    r = run_cli(["fake", f"hydra.run.dir=runs/fake/{name}"], Path.cwd())
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "would give the run the id" in r.stderr, r.stderr
    assert not Path("runs/fake", name).exists()


@pytest.mark.parametrize(("args", "said"), [
    (["--config-name", "nosuch"], "always composes conf/fake.yaml"), (["--config-name=arch"], "run `tfmoe arch`"),
    (["-cn", "fake"], "always composes"), (["--config-path", "/tmp"], "always composes"),
])
def test_config_name_and_path_are_refused_in_one_line(fake_experiment, args: list[str], said: str) -> None:
    r = run_cli(["fake", *args], Path.cwd())
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and said in r.stderr, r.stderr
    assert not Path("runs").exists()


@pytest.mark.parametrize(("args", "code"), [
    (["--seed", "1", "seed=2"], 2), (["-m", "seed=1,2", "--seed", "3"], 2), (["--seed", "1", "seed=1"], 0),
    (["--seed", "4"], 0), (["seed=5"], 0),
])
def test_an_option_and_an_override_of_the_same_key_are_never_merged(fake_experiment, args: list[str],
                                                                    code: int) -> None:
    r = run_cli(["fake", *args], Path.cwd())
    assert r.exit_code == code, r.stderr
    if code == 2:
        assert r.stderr.count("\n") == 1 and "both set seed: pass one of them" in r.stderr
        assert not Path("runs").exists()
    else:
        import pandas as pd

        assert pd.read_parquet(r.run_dir / "run.parquet")["seed"].iloc[0] == int(args[-1].split("=")[-1])
