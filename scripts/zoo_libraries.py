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
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

TITLE = "Third-party attention layers (torchtune, x-transformers, timm)"
TESTS = Path(__file__).resolve().parents[1] / "tests"


def _run(spec: str, overrides: list[str]) -> tuple[int, str, set[str], str]:
    """attn-check impl=spec on the small case -> (exit code, run id, failed checks, refusal text)."""
    from library_cases import SMALL

    from tfmoe.errors import BadInput
    from tfmoe.harness.store.notebook import load_run
    from tfmoe.registry import EXPERIMENTS
    from tfmoe.testing import launched

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


def section() -> tuple[str, dict[str, int]]:
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    import library_cases as cases
    from pytest import MonkeyPatch

    counts = {"configurations": 0, "passed": 0, "false_alarms": 0, "configurations_not_run": 0, "bugs_planted": 0,
              "bugs_caught": 0, "bugs_missed": 0, "bugs_not_run": 0}
    rows: list[tuple[str, str, str, str, str]] = []
    problems = {s: cases.import_problem(s) for s in cases.EXTRAS}

    for spec, overrides, _ in [*cases.CORRECT, *cases.PADDED_QUERIES]:
        lib = cases.library_of(spec)
        counts["configurations"] += 1
        if problems[lib]:
            counts["configurations_not_run"] += 1
            rows.append((lib, _version(lib), f"`{cases.describe(spec, overrides)}`", f"not run: {problems[lib]}", ""))
            continue
        code, run_id, failed, refused = _run(spec, overrides)
        if code == 0:
            counts["passed"] += 1
            policy = _policies(overrides)
            verdict = "passes" + (f" with a declared policy ({', '.join(policy)})" if policy else "")
        else:
            counts["false_alarms"] += 1
            verdict = f"**FALSE ALARM** (exit {code}): " + (refused or "failed " + ", ".join(sorted(failed)))
        rows.append((lib, _version(lib), f"`{cases.describe(spec, overrides)}`", verdict, run_id))

    for plant, spec, overrides, must_fail in cases.PLANTED:
        lib = cases.library_of(spec)
        what = f"`{cases.describe(spec, overrides)}` + planted bug `{plant.__name__.removeprefix('plant_')}`"
        counts["bugs_planted"] += 1
        if problems[lib]:
            counts["bugs_not_run"] += 1
            rows.append((lib, _version(lib), what, f"not run: {problems[lib]}", ""))
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
        rows.append((lib, _version(lib), what, verdict, run_id))

    lines = [f"Correct configurations: {counts['passed']} of {counts['configurations']} pass, "
             f"{counts['false_alarms']} false alarms, {counts['configurations_not_run']} not run. Planted bugs: "
             f"{counts['bugs_caught']} of {counts['bugs_planted']} caught, {counts['bugs_missed']} missed, "
             f"{counts['bugs_not_run']} not run.", "",
             "| library | version | configuration | verdict | run id |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {lib} | {ver} | {conf} | {verdict.replace('|', '/')} | {run_id} |"
              for lib, ver, conf, verdict, run_id in rows]
    return "\n".join(lines) + "\n", counts


if __name__ == "__main__":
    text, totals = section()
    print(f"## {TITLE}\n\n{text}")
    print(totals)
