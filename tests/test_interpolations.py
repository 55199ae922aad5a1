"""An interpolation that cannot resolve (`seed=${oc.env:NOPE}`) is bad input: exit 2 in one line before any run
directory exists, in a single run and in every value of a sweep; one that resolves runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tfmoe.api.testing import run_cli


def _dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_dir()) if root.exists() else []


@pytest.mark.parametrize("args", [
    ["seed=${oc.env:TFMOE_TEST_NOPE}"], ["steps=${nosuch}"], ["coef=${oc.env:TFMOE_TEST_NOPE}"],
    ["-m", "seed=1,${oc.env:TFMOE_TEST_NOPE}"], ["-m", "seed=${oc.env:TFMOE_TEST_NOPE},1"],
    ["-m", "seed=1,2", "steps=${nosuch}"],
])
def test_an_unresolvable_interpolation_exits_2_before_any_directory(fake_experiment,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     args: list[str]) -> None:
    monkeypatch.delenv("TFMOE_TEST_NOPE", raising=False)
    r = run_cli(["fake", *args], Path.cwd())
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert "cannot resolve" in r.stderr and ("TFMOE_TEST_NOPE" in r.stderr or "nosuch" in r.stderr)
    assert _dirs(Path("runs")) == []


def test_a_sweep_names_the_job_whose_value_fails(fake_experiment, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TFMOE_TEST_NOPE", raising=False)
    r = run_cli(["fake", "-m", "seed=1,2,${oc.env:TFMOE_TEST_NOPE}"], Path.cwd())
    assert r.exit_code == 2 and r.stderr.startswith("error: sweep job 2 ") and "1 of 3 jobs" in r.stderr


def test_an_interpolation_that_resolves_runs(fake_experiment, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TFMOE_TEST_SEED", "7")
    r = run_cli(["fake", "seed=3", "steps=${seed}", "coef=${oc.env:TFMOE_TEST_SEED}"], Path.cwd())
    assert r.exit_code == 0, r.stderr
    r = run_cli(["fake", "-m", "seed=1,2", "steps=${seed}"], Path.cwd())
    assert r.exit_code == 0, r.stderr
