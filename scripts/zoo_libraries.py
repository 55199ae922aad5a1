"""The attention zoo's third-party section: attn-check on torchtune's, x-transformers' and timm's attention layers
through the shipped adapters, each configuration a named run under ./runs.

``section()`` runs every correct configuration and every planted bug of ``tests/library_cases.py`` (the table
``tests/test_attn_libraries.py`` judges) through ``tfmoe attn-check`` in-process, and returns the markdown table
(library, version, configuration, verdict, run id) and the counts; ``scripts/zoo.py`` puts it in
``experiments/zoo.md``. Alone: ``python scripts/zoo_libraries.py`` prints the section. A library that does not
import is listed as not run, with the reason."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

TITLE = "Third-party attention layers (torchtune, x-transformers, timm)"
TESTS = Path(__file__).resolve().parents[1] / "tests"


def _run(spec: str, overrides: list[str]) -> tuple[int, str, set[str], str]:
    """attn-check impl=spec on the small case -> (exit code, run id, failed checks, refusal text)."""
    from library_cases import SMALL

    from tfmoe.api.testing import launched
    from tfmoe.contract.errors import BadInput
    from tfmoe.contract.registry import EXPERIMENTS
    from tfmoe.harness.store.notebook import load_run

    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # the run's tables
            code, made = launched(EXPERIMENTS["attn-check"], [*SMALL, f"impl={spec}", *overrides])
    except BadInput as exc:
        return 2, "", set(), str(exc)
    if not made:
        return code, "", set(), ""
    run = load_run(made[-1])
    checks = run.checks
    failed = set() if checks.empty else set(checks.loc[~checks["passed"].astype(bool), "check"])
    return code, str(run.run.get("run_id", made[-1].name)), failed, ""


def _version(scheme: str) -> str:
    from library_cases import EXTRAS

    try:
        return version(EXTRAS[scheme][2])
    except PackageNotFoundError:
        return "not installed"


def _policies(overrides: list[str]) -> list[str]:
    from library_cases import POLICIES

    return [o for o in overrides if o.startswith(POLICIES)]


COUNTS = ("configurations", "passed", "false_alarms", "configurations_not_run", "bugs_planted", "bugs_caught",
          "bugs_missed", "bugs_not_run")
# A library that cannot import beside the main venv's torch runs in the venv its CI script builds: timm imports
# torchvision, which needs the torch of scripts/test-timm.sh's .venv-timm.
SIBLING_VENVS = {"timm": (Path(__file__).resolve().parents[1] / ".venv-timm", "bash scripts/test-timm.sh")}
Row = tuple[str, str, str, str, str]


def judge(libraries: set[str] | None = None) -> tuple[dict[int, Row], dict[str, int]]:
    """Every correct configuration and planted bug of the libraries named (all: None), run here.

    -> (row number in the table -> row, counts). A library that does not import here is 'not run' with the reason."""
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    import library_cases as cases
    from pytest import MonkeyPatch

    counts = dict.fromkeys(COUNTS, 0)
    rows: dict[int, Row] = {}
    problems = {s: cases.import_problem(s) for s in cases.EXTRAS}
    table = [(None, spec, overrides, None) for spec, overrides, _ in [*cases.CORRECT, *cases.PADDED_QUERIES]]
    table += list(cases.PLANTED)
    for number, (plant, spec, overrides, must_fail) in enumerate(table):
        lib = cases.library_of(spec)
        if libraries is not None and lib not in libraries:
            continue
        conf = f"`{cases.describe(spec, overrides)}`"
        if plant is None:
            counts["configurations"] += 1
            if problems[lib]:
                counts["configurations_not_run"] += 1
                rows[number] = (lib, _version(lib), conf, f"not run: {problems[lib]}", "")
                continue
            code, run_id, failed, refused = _run(spec, overrides)
            if code == 0:
                counts["passed"] += 1
                policy = _policies(overrides)
                verdict = "passes" + (f" with a declared policy ({', '.join(policy)})" if policy else "")
            else:
                counts["false_alarms"] += 1
                verdict = f"**FALSE ALARM** (exit {code}): " + (refused or "failed " + ", ".join(sorted(failed)))
            rows[number] = (lib, _version(lib), conf, verdict, run_id)
            continue
        what = f"{conf} + planted bug `{plant.__name__.removeprefix('plant_')}`"
        counts["bugs_planted"] += 1
        if problems[lib]:
            counts["bugs_not_run"] += 1
            rows[number] = (lib, _version(lib), what, f"not run: {problems[lib]}", "")
            continue
        with MonkeyPatch.context() as mp:
            plant(mp)
            code, run_id, failed, refused = _run(spec, [*overrides, cases.PLANTED_GROUPS])
        if must_fail <= failed:
            counts["bugs_caught"] += 1
            verdict = "bug caught: " + ", ".join(sorted(failed)) + " failed"
        else:
            counts["bugs_missed"] += 1
            verdict = f"**BUG MISSED** (exit {code}): " + (refused or "failed " + (", ".join(sorted(failed)) or "nothing"))
        rows[number] = (lib, _version(lib), what, verdict, run_id)
    return rows, counts


def _judge_in_sibling_venv(library: str) -> tuple[dict[int, Row], dict[str, int]] | None:
    """The library's rows judged by this script in its sibling venv (None when that venv is not built)."""
    venv, _ = SIBLING_VENVS[library]
    if not (venv / "bin" / "python").exists():
        return None
    out = subprocess.run([str(venv / "bin" / "python"), __file__, "--json", library], capture_output=True, text=True,
                         check=True, cwd=Path.cwd()).stdout
    found = json.loads(out.splitlines()[-1])
    return {int(k): tuple(v) for k, v in found["rows"].items()}, found["counts"]


def section() -> tuple[str, dict[str, int]]:
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    import library_cases as cases

    elsewhere = {lib for lib in SIBLING_VENVS if cases.import_problem(lib)}
    rows, counts = judge(set(cases.EXTRAS) - elsewhere)
    notes = []
    for lib in sorted(elsewhere):
        judged = _judge_in_sibling_venv(lib)
        venv, build = SIBLING_VENVS[lib]
        if judged is None:
            judged = judge({lib})
            notes.append(f"{lib}'s rows are not run: they run in {venv.name}, which `{build}` builds.")
        else:
            notes.append(f"{lib}'s rows ran in {venv.name} (built by `{build}`), as CI runs them.")
        rows.update(judged[0])
        counts = {k: counts[k] + judged[1][k] for k in COUNTS}
    ordered = [rows[n] for n in sorted(rows)]

    lines = [f"Correct configurations: {counts['passed']} of {counts['configurations']} pass, "
             f"{counts['false_alarms']} false alarms, {counts['configurations_not_run']} not run. Planted bugs: "
             f"{counts['bugs_caught']} of {counts['bugs_planted']} caught, {counts['bugs_missed']} missed, "
             f"{counts['bugs_not_run']} not run. " + " ".join(notes), "",
             "| library | version | configuration | verdict | run id |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {lib} | {ver} | {conf} | {verdict.replace('|', '/')} | {run_id} |"
              for lib, ver, conf, verdict, run_id in ordered]
    return "\n".join(lines) + "\n", counts


if __name__ == "__main__":
    if sys.argv[1:2] == ["--json"]:  # a sibling venv's part: its rows and counts as one JSON line
        found, totals = judge(set(sys.argv[2:]))
        print(json.dumps({"rows": found, "counts": totals}))
        sys.exit(0)
    text, totals = section()
    print(f"## {TITLE}\n\n{text}")
    print(totals)
