"""tfmoe conclude: append-only conclusions.parquet, three headings in show and summary.md, bad input exits 2."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from tfmoe.api.testing import launched, run_cli
from tfmoe.harness.method import conclusions


def test_conclude_appends_never_rewrites_and_lists_three_headings(fake_experiment) -> None:
    code, dirs = launched(fake_experiment, [])
    assert code == 0
    run_dir = dirs[-1]
    summary_before = (run_dir / "summary.md").read_text()
    r = run_cli(["conclude", str(run_dir), "--proven", "loss falls every step", "--inferred", "it would keep falling"],
                Path.cwd())
    assert r.exit_code == 0, r.stderr
    first = pd.read_parquet(run_dir / "conclusions.parquet")
    assert list(first["kind"]) == ["proven", "inferred"] and first["written_at"].notna().all()
    r = run_cli(["conclude", run_dir.name, "--unverified", "holds on CUDA", "--proven", "seed 0 reproduces"], Path.cwd())
    assert r.exit_code == 0, r.stderr
    both = pd.read_parquet(run_dir / "conclusions.parquet")
    pd.testing.assert_frame_equal(both.iloc[:2].reset_index(drop=True), first)  # earlier rows untouched
    assert list(both["kind"]) == ["proven", "inferred", "proven", "unverified"]
    summary = (run_dir / "summary.md").read_text()
    assert summary.startswith(summary_before.rstrip())  # the run's own summary is kept
    assert summary.count("## Conclusions") == 1
    for heading in conclusions.KINDS.values():
        assert f"### {heading}" in summary
    proven = summary.split("### Proven")[1].split("### Inferred")[0]
    assert "loss falls every step" in proven and "seed 0 reproduces" in proven and "holds on CUDA" not in proven
    shown = run_cli(["show", str(run_dir)], Path.cwd())
    assert "### Not yet verified" in shown.stdout and "holds on CUDA" in shown.stdout
    body = json.loads(run_cli(["show", str(run_dir), "--format", "json"], Path.cwd()).stdout)
    assert [c["kind"] for c in body["conclusions"]] == ["proven", "inferred", "proven", "unverified"]


def test_conclude_bad_input_exits_2_and_writes_nothing(fake_experiment) -> None:
    run_dir = launched(fake_experiment, [])[1][-1]
    for args, needle in [([], "nothing to conclude"), (["--proven", "  "], "--proven is empty")]:
        r = run_cli(["conclude", str(run_dir), *args], Path.cwd())
        assert r.exit_code == 2 and needle in r.stderr, r.stderr
    r = run_cli(["conclude", "no-such-run", "--proven", "x"], Path.cwd())
    assert r.exit_code == 2 and "not found" in r.stderr
    assert not (run_dir / "conclusions.parquet").exists()
