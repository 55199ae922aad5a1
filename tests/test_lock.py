"""requirements.lock: what `make setup` installs is exactly what it pins, and `tfmoe show` flags a run made with
other versions (docs/install.md)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tfmoe.api.testing import launched, run_cli
from tfmoe.harness.store.lockfile import canonical, lock_path, parse_lock, public, read_lock, version_drift

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "requirements.lock"
spec = importlib.util.spec_from_file_location("check_lock", REPO / "scripts" / "check_lock.py")
check_lock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_lock)


def test_the_lock_pins_the_whole_make_test_environment_with_hashes() -> None:
    text = LOCK.read_text(encoding="utf-8")
    pins = read_lock(LOCK)
    assert len(pins) > 100 and lock_path(REPO) == LOCK
    for package in ("torch", "hydra-core", "transformers", "mlflow", "hydra-ray-launcher", "pytest", "ruff", "duckdb"):
        assert package in pins, package  # core + the extras dev, hf, mlflow, ray
    assert pins["torch"] == "2.13.0+cpu"  # the local CPU build, not a CUDA one
    for name in pins:  # every pin line is followed by its hashes
        block = text.lower().split(f"\n{name}==", 1)[1].split("\n", 2)
        assert block[1].strip().startswith("--hash=sha256:"), name


@pytest.mark.skipif(not (Path(sys.prefix) / ".installed").exists(), reason="not a venv made by `make setup`")
def test_this_venv_holds_exactly_the_locked_versions() -> None:
    """What CI's fresh `make setup` made: `pip freeze --all` shows every locked package at its locked version."""
    assert check_lock.mismatches(read_lock(LOCK), check_lock.frozen(), set()) == []


def test_parse_lock_reads_pins_and_skips_hashes_comments_and_urls() -> None:
    text = ("# header\n--find-links /x\nFoo_Bar.baz==1.2 \\\n    --hash=sha256:ab\n    # via x\n"
            "torch==2.13.0+cpu ; python_version >= '3.10' \\\n    --hash=sha256:cd\n-e file:///src/tfmoe\n"
            "tfmoe @ file:///src\n")
    assert parse_lock(text) == {"foo-bar-baz": "1.2", "torch": "2.13.0+cpu"}
    assert parse_lock("") == {} and canonical("Hydra_Core") == "hydra-core" and public("2.13.0+cu128") == "2.13.0"


def test_check_lock_names_each_package_that_differs_or_is_missing() -> None:
    locked = {"numpy": "2.4.6", "torch": "2.13.0+cpu", "rich": "14.0.0"}
    installed = {"numpy": "2.3.0", "torch": "2.13.0+cpu", "pip": "26.3"}
    assert check_lock.mismatches(locked, installed, set()) == [
        "numpy: locked 2.4.6, installed 2.3.0", "rich: locked 14.0.0, installed nothing"]
    assert check_lock.mismatches(locked, {**installed, "numpy": "2.4.6", "rich": "14.0.0"}, set()) == []
    assert check_lock.mismatches(locked, {"torch": "2.13.0+cu128"}, {"torch", "numpy", "rich"}) == []


def test_the_lock_without_torch_keeps_every_other_entry_and_its_hashes() -> None:
    text = LOCK.read_text(encoding="utf-8")
    rest = check_lock.without(text, {"torch"})
    assert parse_lock(rest) == {k: v for k, v in parse_lock(text).items() if k != "torch"}
    torch_entry = text.split("\ntorch==", 1)[1].split("\n    # via", 1)[0]
    assert "\ntorch==" not in rest and rest.count("--hash=") == text.count("--hash=") - torch_entry.count("--hash=")
    assert check_lock.without(text, set()) == text.rstrip("\n") + "\n"


def test_check_lock_exits_1_naming_the_package_for_a_lock_this_venv_does_not_match(tmp_path: Path, capsys) -> None:
    """A copy of the real lock with one version planted wrong: the check fails and names that package."""
    planted = tmp_path / "requirements.lock"
    text = LOCK.read_text(encoding="utf-8")
    planted.write_text(text.replace("\nrich==", "\nrich==0.0.1\n# was rich==", 1), encoding="utf-8")
    assert check_lock.main(["--lock", str(planted), "--skip", "rich"]) in (0, 1)
    code = check_lock.main(["--lock", str(planted)])
    err = capsys.readouterr().err
    assert code == 1 and "rich: locked 0.0.1, installed " in err


def _real_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from tfmoe.contract.registry import EXPERIMENTS

    monkeypatch.chdir(tmp_path)
    code, (run_dir,) = launched(EXPERIMENTS["shift-labels"], ["threads=1"])
    assert code == 0
    return run_dir


def _set_recorded(run_dir: Path, **versions: str) -> None:
    """Rewrite run.parquet's version columns in place (the real file, as a run made elsewhere would have them)."""
    path = run_dir / "run.parquet"
    table = pq.read_table(path)
    for column, value in versions.items():
        i = table.schema.get_field_index(column)
        table = table.set_column(i, table.schema.field(i), pa.array([value], type=table.schema.field(i).type))
    pq.write_table(table, path)


def test_show_flags_a_run_whose_recorded_versions_differ_from_the_lock(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = _real_run(tmp_path, monkeypatch)
    locked = read_lock(LOCK)
    _set_recorded(run_dir, numpy="1.26.0", hydra="1.3.2")
    monkeypatch.setenv("COLUMNS", "200")  # show wraps its prose to the terminal (at most 120 columns)
    result = run_cli(["show", run_dir.name], tmp_path)
    assert result.exit_code == 0
    lines = [line for line in result.stdout.splitlines() if line.startswith("version drift:")]
    assert lines == [
        f"version drift: numpy 1.26.0 in this run, {locked['numpy']} in requirements.lock (`make setup` installs the "
        "locked versions)",
        f"version drift: hydra-core 1.3.2 in this run, {locked['hydra-core']} in requirements.lock (`make setup` "
        "installs the locked versions)"]
    shown = json.loads(run_cli(["show", run_dir.name, "--format", "json"], tmp_path).stdout)
    assert shown["version_drift"] == [{"package": "numpy", "run": "1.26.0", "locked": locked["numpy"]},
                                      {"package": "hydra-core", "run": "1.3.2", "locked": locked["hydra-core"]}]


def test_show_says_nothing_of_a_run_made_with_the_locked_versions(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    run_dir = _real_run(tmp_path, monkeypatch)
    locked = read_lock(LOCK)
    _set_recorded(run_dir, numpy=locked["numpy"], pandas=locked["pandas"], pyarrow=locked["pyarrow"],
                  hydra=locked["hydra-core"], torch="2.13.0+cu128")  # a CUDA build of the locked torch
    result = run_cli(["show", run_dir.name], tmp_path)
    assert result.exit_code == 0 and "version drift" not in result.stdout
    assert json.loads(run_cli(["show", run_dir.name, "--format", "json"], tmp_path).stdout)["version_drift"] == []


def test_version_drift_boundaries() -> None:
    locked = {"torch": "2.13.0+cpu", "numpy": "2.4.6", "hydra-core": "1.3.8"}
    assert version_drift({"torch": "2.12.0", "numpy": "2.4.6"}, locked) == [("torch", "2.12.0", "2.13.0+cpu")]
    assert version_drift({"torch": None, "numpy": float("nan"), "pandas": "1.0"}, locked) == []  # not recorded/locked
    assert version_drift({}, {}) == []


def _makefile_extras() -> list[str]:
    import re

    return re.search(r"^EXTRAS = (.+)$", (REPO / "Makefile").read_text(), re.M).group(1).strip().split(",")


def stale(wanted: list[str], pins: dict[str, str]) -> list[str]:
    """Each requirement the lock does not pin within its range."""
    from packaging.requirements import Requirement

    lines = []
    for text in wanted:
        req = Requirement(text)
        pinned = pins.get(canonical(req.name))
        if pinned is None or not req.specifier.contains(pinned, prereleases=True):
            lines.append(f"{text}: locked {pinned or 'nothing'}")
    return lines


def test_the_lock_is_current_with_pyproject_every_requirement_is_pinned_within_its_range() -> None:
    """A requirement added to pyproject.toml (a new extra, a raised floor) without `make lock` fails here, naming it."""
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"])
    for extra in _makefile_extras():
        wanted += project["optional-dependencies"][extra]
    assert len(wanted) > 20
    problems = stale(wanted, read_lock(LOCK))
    assert not problems, "requirements.lock is stale, run `make lock`: " + "; ".join(problems)


def test_a_requirement_the_lock_does_not_satisfy_is_named() -> None:
    pins = read_lock(LOCK)
    assert stale(["torch==2.13.0", "typer>=0.12", "Hydra_Core==1.3.8"], pins) == []  # local label, names
    assert stale(["torch==2.12.0", "not-a-locked-package>=1", f"numpy>{pins['numpy']}"], pins) == [
        f"torch==2.12.0: locked {pins['torch']}", "not-a-locked-package>=1: locked nothing",
        f"numpy>{pins['numpy']}: locked {pins['numpy']}"]
