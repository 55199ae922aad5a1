"""Read-side formatting for the notebook commands: runs, show, diff, and the outcome of a launch."""

from __future__ import annotations

import datetime as dt
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape

from tfmoe.contract.errors import BadInput
from tfmoe.contract.status import Status, exit_code_for, worst_exit_code
from tfmoe.contract.tables import Rows, cell, from_frame, print_rows
from tfmoe.harness.store.notebook import (
    RunData,
    load_run,
    read_run_row,
    read_run_state,
    resolve_run,
    where_running,
)
from tfmoe.harness.store.rundir import (
    EXPECTATIONS_FILE,
    check_applicable,
    checks_cell,
    is_missing,
    read_parquet,
)

if TYPE_CHECKING:
    import pandas as pd

console = Console(highlight=False)
STATUS_STYLES = {Status.OK: "green", Status.FAILED: "red", Status.ERROR: "yellow"}  # any other: magenta

ENV_KEYS = ["device", "device_name", "dtype", "python", "torch", "cuda", "cudnn", "numpy", "pandas", "pyarrow",
            "hydra", "hostname", "platform", "git_commit", "git_dirty"]


def exit_code_of(run_dirs: list[Path]) -> int:
    """The exit code of these runs together: the worst of each one's (its status's, while it records none)."""
    import pandas as pd

    codes = []
    for d in run_dirs:
        run = read_run_state(d)
        code = run.get("exit_code")
        if run["status"] in (Status.LOST, Status.RUNNING) or code is None or pd.isna(code):  # none recorded (yet)
            codes.append(exit_code_for(run["status"]))
        else:
            codes.append(int(code))
    return worst_exit_code(codes)


def _runs_frame(run_dirs: list[Path]) -> pd.DataFrame:
    import pandas as pd

    rows = []
    for d in run_dirs:  # only run.parquet and checks.parquet: the summary needs no tensors or metrics
        run = read_run_row(d)
        checks = read_parquet(d / "checks.parquet") if (d / "checks.parquet").exists() else pd.DataFrame()
        rows.append({"run_id": run["run_id"], "experiment": run["experiment"], "status": run["status"],
                     "checks": checks_cell(checks.to_dict("records")), "expected": _expectations_cell(d),
                     "wall_s": round(float(run["wall_s"] or 0.0), 2), "path": str(d)})
    df = pd.DataFrame(rows)
    if not df.empty and (df["expected"] == "").all():
        df = df.drop(columns=["expected"])
    return df


def _expectations_cell(run_dir: Path) -> str:
    """'1/2 held' for the outcome table ('' when the run stated no expectation)."""
    path = run_dir / EXPECTATIONS_FILE
    if not path.exists():
        return ""
    df = read_parquet(path)
    return f"{int((df['held'] == True).sum())}/{len(df)} held" if len(df) else ""  # noqa: E712 (nullable)


OUTCOME_TABLE_MAX = 50  # a sweep with more jobs gets one row per status; `tfmoe runs` / `tfmoe sql` list every job


def print_outcome(run_dirs: list[Path], sweep_dirs: list[Path], title: str | None = None) -> None:
    if len(run_dirs) > OUTCOME_TABLE_MAX:
        _print_outcome_by_status(run_dirs, sweep_dirs, title)
        return
    if not run_dirs:  # a sweep none of whose jobs started: its lines name them
        print_sweep_lines(sweep_dirs)
        return
    df = _runs_frame(run_dirs)
    table_df = df.drop(columns=["path"])
    table = from_frame(table_df, title or ("tfmoe run" if len(df) == 1 else f"tfmoe sweep: {len(df)} jobs"))
    table.styles = [STATUS_STYLES.get(s, "magenta") for s in table_df["status"]]
    table.print_to(console)
    if len(df) == 1 and not sweep_dirs:
        console.print(f"run directory: {df.iloc[0]['path']}", soft_wrap=True, markup=False)
    print_sweep_lines(sweep_dirs)


def _print_outcome_by_status(run_dirs: list[Path], sweep_dirs: list[Path], title: str | None) -> None:
    """A big sweep's outcome: jobs per status (and their wall time), then every job that did not end ok."""
    import pandas as pd

    states = pd.DataFrame([read_run_state(d) for d in run_dirs])
    states["wall_s"] = pd.to_numeric(states.get("wall_s"), errors="coerce")
    table = Rows(title or f"tfmoe sweep: {len(run_dirs)} jobs", ["status", "jobs", "exit", "wall_s total"])
    for status, group in states.groupby("status", sort=False):
        table.add(status, len(group), exit_code_for(str(status)), round(float(group["wall_s"].sum()), 1),
                  style=STATUS_STYLES.get(str(status), "magenta"))
    table.print_to(console)
    console.print(f"({len(run_dirs)} jobs: more than {OUTCOME_TABLE_MAX}, so one row per status; every job is in "
                  "sweep.parquet, `tfmoe runs` and `tfmoe sql`)", soft_wrap=True, markup=False, highlight=False)
    print_sweep_lines(sweep_dirs)


def print_sweep_lines(sweep_dirs: list[Path]) -> None:
    """Each sweep's sweep.parquet path, then every job of it that did not end ok."""
    for s in sweep_dirs:
        console.print(f"sweep: {s}/sweep.parquet", soft_wrap=True, markup=False)
        for line in sweep_problem_lines(s):
            console.print(line, soft_wrap=True, markup=False, highlight=False)


def sweep_problem_lines(sweep_dir: Path) -> list[str]:
    """'job N (overrides): status: error' for every job of a sweep that did not end ok."""
    from tfmoe.harness.store.sweeps import sweep_jobs

    path = Path(sweep_dir) / "sweep.parquet"
    if not path.exists():
        return []
    df = read_parquet(path).drop_duplicates("job")
    jobs = sweep_jobs(Path(sweep_dir)) or []
    lines = []
    for row in df.to_dict("records"):
        if row["status"] == Status.OK:
            continue
        job = str(row["job"])
        overrides = " ".join(jobs[int(job)]) if job.isdigit() and int(job) < len(jobs) else ""
        error = row.get("error")
        lines.append(f"job {job}{f' ({overrides})' if overrides else ''}: {row['status']}"
                     + (f": {error}" if isinstance(error, str) and error else ""))
    return lines


def print_runs_table(run_dirs: list[Path]) -> None:
    if run_dirs:
        print_outcome(run_dirs, [], title=f"tfmoe all: {len(run_dirs)} runs")


def print_frame(df: pd.DataFrame, fmt: str, title: str = "") -> None:
    """``df`` on stdout as json (row objects), md (a titled markdown table) or a terminal table."""
    if fmt == "json":
        print(df.to_json(orient="records", date_format="iso", default_handler=str))
    else:
        print_rows(from_frame(df, title), fmt, console)


# --------------------------------------------------------------------------------------------- show
SHOW_WIDTH = 120  # `show` into a file or a pipe: its tables fit this many columns (COLUMNS overrides it)
_FIT: list[int | None] = [None]  # the width `show` fits its tables to now (None: print_rows' own rule)


def show_width(full_width: bool) -> int | None:
    """The columns `show` fits its tables to: the terminal's, else $COLUMNS or SHOW_WIDTH; None (each table at
    its natural width) with ``--full-width``."""
    import os

    if full_width:
        return None
    if console.is_terminal:
        return console.width
    try:
        return max(40, int(os.environ.get("COLUMNS", "")))
    except ValueError:
        return SHOW_WIDTH


def say(text: str) -> None:
    """Prose `show` prints (the likely cause, version drift, conclusions): each line wrapped to the width its tables
    fit, at most SHOW_WIDTH (a reading width), continuation lines indented; as it is with ``--full-width``."""
    import textwrap

    width = _FIT[0]
    if width is None:
        print(text)
        return
    width = min(width, SHOW_WIDTH)
    out = []
    for line in text.splitlines() or [""]:
        lead = line[:len(line) - len(line.lstrip())]
        out.extend(textwrap.wrap(line, width, initial_indent="", subsequent_indent=lead + "  ",
                                 break_on_hyphens=False) or [line])
    print("\n".join(out))


def print_records(rows: list[dict[str, Any]], fmt: str, title: str, drop: tuple[str, ...] = ()) -> None:
    """A table's rows (notebook.RunData.rows: pandas' values, pandas not imported) as a md or terminal table, like
    :func:`print_frame` prints the same table as a DataFrame; ``drop``: columns left out (those it has)."""
    columns = [c for c in (rows[0] if rows else {}) if c not in drop]
    print_rows(Rows(title, columns, [tuple(r[c] for c in columns) for r in rows]), fmt, console, _FIT[0])


def show(ref: str, runs_root: Path, fmt: str, full_width: bool = False) -> None:
    """`tfmoe show`: one run's record, read with pyarrow alone (no pandas: start-up is most of its time); its
    tables fit the terminal, or :func:`show_width` when redirected (``full_width``: each at its natural width)."""
    _FIT[0] = show_width(full_width)
    try:
        _show(ref, runs_root, fmt)
    finally:
        _FIT[0] = None


def _show(ref: str, runs_root: Path, fmt: str) -> None:
    data = load_run(resolve_run(ref, runs_root))
    no_values = ("values",)
    if fmt == "json":
        print(json.dumps({
            "path": str(data.path), "run": {k: _jsonable(v) for k, v in data.run.items()},
            "config": data.config, "checks": data.rows("checks"),
            "expectations": data.rows("expectations"),
            "metrics": data.rows("metrics"), "timings": data.rows("timings"),
            "tensors": [{k: v for k, v in r.items() if k not in no_values} for r in data.rows("tensors")],
            "plots": [str(p) for p in data.plots],
            "conclusions": _conclusions_records(data.path),
            "version_drift": [dict(zip(("package", "run", "locked"), d, strict=True)) for d in _drift(data.run)],
        }, default=_jsonable))
        return
    run = dict(data.run)
    if run["status"] == Status.RUNNING:
        run["status"] = f"running {where_running(run)}"
    elif run["status"] == Status.LOST:
        run["status"] = (f"lost (recorded running, but its process {cell(run.get('pid'))} is gone from "
                         f"{cell(run.get('hostname'))}; last heartbeat {cell(run.get('heartbeat_at'))})")
    head = [{"key": k, "value": cell(run.get(k))} for k in
            ["run_id", "experiment", "status", "started_at", "wall_s", "seed", "overrides",
             "error", "peak_rss_bytes", "peak_device_mem_bytes", "notes", *ENV_KEYS,
             "pid", "process_started_at", "heartbeat_at"]]
    print_records(head, fmt, f"run {run['run_id']} ({data.path})")
    for package, recorded, locked in _drift(data.run):
        say(f"version drift: {package} {recorded} in this run, {locked} in requirements.lock "
            "(`make setup` installs the locked versions)")
    if data.config_missing:
        said = (f"config missing: {data.path}/.hydra/config.yaml is not in the run directory (the overrides above "
                "are what the run recorded)")
        say(f"\n### config\n\n{said}" if fmt == "md" else said)
    elif fmt == "md":
        print("\n### config\n\n```yaml\n" + data.config + "```")
    else:
        console.print("[bold]config[/]\n" + escape(data.config))  # the user's text, never markup
    checks = data.rows("checks")
    if checks:
        shown = [{**c, "passed": c["passed"] if check_applicable(c) else "n/a"} for c in checks]
        print_records(shown, fmt, f"checks {checks_cell(checks)}", drop=("applicable",))
        for inference in _inferences(data):
            say(inference.line())
    expectations = data.rows("expectations")
    if expectations:
        print_records(expectations, fmt, "expectations (your predictions, written before the run)",
                      drop=("label", "metric", "aggregate", "judged_at"))
    metrics = data.rows("metrics")
    if metrics:
        print_records(metrics[:60], fmt, f"metrics ({len(metrics)} rows{', first 60' if len(metrics) > 60 else ''})")
    timings = data.rows("timings")
    if timings:
        print_records(timings, fmt, "timings")
    tensors = data.rows("tensors")
    if tensors:
        print_records(tensors, fmt, "tensors", drop=no_values)
    plots = data.plots
    if plots:
        line = "plots: " + ", ".join(str(p) for p in plots)
        fits = _FIT[0] is None or len(line) <= _FIT[0]
        print(line if fits else "plots:\n" + "\n".join(f"  {p}" for p in plots))
    _show_conclusions(data.path)


def _drift(run: Any) -> list[tuple[str, str, str]]:
    """The run's recorded versions that differ from the checkout's requirements.lock (none without a lock)."""
    from tfmoe.harness.store.lockfile import lock_path, read_lock, version_drift

    path = lock_path()
    return version_drift(dict(run), read_lock(path)) if path is not None else []


def _show_conclusions(run_dir: Path) -> None:
    from tfmoe.harness.method.conclusions import markdown, read

    rows = read(run_dir)
    if rows:
        say("\nconclusions\n\n" + "\n".join(markdown(rows)).rstrip())


def _inferences(data: RunData) -> list[Any]:
    """Likely causes of the failed checks from the planted-bug catalogue (inferences, shown next to the checks)."""
    checks = data.rows("checks")
    if all(bool(c["passed"]) for c in checks):  # none to explain (diagnose's own rule): no YAML, no catalogue
        return []
    import yaml

    from tfmoe.harness.method.diagnosis import checks_mapping, diagnose

    try:
        cfg = yaml.safe_load(data.config) or {}
    except yaml.YAMLError:
        cfg = {}
    return diagnose(str(data.run["experiment"]), checks_mapping(checks), data.rows("metrics"), cfg)


def _conclusions_records(run_dir: Path) -> list[dict[str, Any]]:
    from tfmoe.harness.method.conclusions import read

    return read(run_dir)


def _jsonable(v: Any) -> Any:
    if hasattr(v, "tolist"):
        return v.tolist()
    if isinstance(v, dt.datetime):  # pandas' Timestamp too
        return v.isoformat()
    if isinstance(v, float) and math.isnan(v):
        return None
    return v


# --------------------------------------------------------------------------------------------- diff
def flatten_keys(d: Any, prefix: str = "") -> dict[str, Any]:
    """A nested dict as one level of dotted keys (``{"a": {"b": 1}}`` -> ``{"a.b": 1}``)."""
    out: dict[str, Any] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(flatten_keys(v, f"{prefix}{k}."))
    else:
        out[prefix[:-1]] = d
    return out


def _config_dict(data: RunData) -> dict[str, Any]:
    import yaml

    try:
        cfg = yaml.safe_load(data.config) or {}
    except yaml.YAMLError:
        raise BadInput(f"{data.path}/.hydra/config.yaml is not valid YAML: the run is corrupt") from None
    flat = flatten_keys(cfg)
    flat.pop("run_root", None)
    return flat


def _same(a: Any, b: Any, rtol: float = 1e-9) -> bool:
    """Equal values: both missing, floats within ``rtol``, or equal otherwise (never raises)."""
    import pandas as pd

    if is_missing(a) or is_missing(b):
        return is_missing(a) and is_missing(b)
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=rtol, abs_tol=0.0)
    try:
        eq = a == b
        return bool(eq) if pd.api.types.is_scalar(eq) else bool(len(a) == len(b) and all(eq))
    except (TypeError, ValueError):
        return repr(a) == repr(b)


def dtype_tolerance(dtype_a: str, dtype_b: str) -> float:
    """Relative tolerance for comparing saved tensors: a few ulps of the coarser dtype (0 for exact types)."""
    eps = {"float16": 9.77e-4, "bfloat16": 7.81e-3, "float32": 1.19e-7, "float64": 2.22e-16}
    return 4 * max(eps.get(dtype_a, 0.0), eps.get(dtype_b, 0.0))


def _is_measured(name: str, flag: Any, measured_names: frozenset[str]) -> bool:
    """A machine measurement: recorded ``measured=True`` or declared so (declared_metrics.MEASURED)."""
    return (not is_missing(flag) and str(flag) in ("True", "true", "1")) or str(name) in measured_names


def diff_runs(a: RunData, b: RunData, all_rows: bool) -> dict[str, pd.DataFrame]:
    """Every section of a diff as a DataFrame with a boolean ``differs`` column. Saved tensors are compared as the
    float64 values tensors.parquet holds (exact for every saved dtype): numpy, no torch to import."""
    import numpy as np
    import pandas as pd

    sections: dict[str, pd.DataFrame] = {}
    if a.config_missing or b.config_missing:  # nothing to compare: say so, never invent differences
        sections["config"] = pd.DataFrame([{"key": ".hydra/config.yaml", "A": "missing" if a.config_missing else "kept",
                                            "B": "missing" if b.config_missing else "kept", "differs": False}])
    else:
        ca, cb = _config_dict(a), _config_dict(b)
        sections["config"] = pd.DataFrame([
            {"key": k, "A": cell(ca.get(k, "(absent)")), "B": cell(cb.get(k, "(absent)")),
             "differs": not _same(ca.get(k, "(absent)"), cb.get(k, "(absent)"))}
            for k in sorted(set(ca) | set(cb))])
    sections["environment"] = pd.DataFrame([
        {"key": k, "A": cell(a.run.get(k)), "B": cell(b.run.get(k)), "differs": cell(a.run.get(k)) != cell(b.run.get(k))}
        for k in ENV_KEYS])
    # metrics: join on name + step + tags
    ma, mb = a.metrics.copy(), b.metrics.copy()
    keys = sorted((set(ma.columns) | set(mb.columns)) - {"value", "measured"})
    for df in (ma, mb):
        for k in keys:
            if k not in df:
                df[k] = None
            df[k] = df[k].astype(object).where(df[k].notna(), None).map(lambda v: "" if v is None else str(v))
        df["_dup"] = df.groupby(keys, dropna=False).cumcount() if keys else 0
    from tfmoe.harness.method.declared_metrics import measured_for

    measured_names = measured_for(str(a.run.get("experiment"))) | measured_for(str(b.run.get("experiment")))
    if keys:
        merged = ma.merge(mb, on=[*keys, "_dup"], how="outer", suffixes=("_A", "_B"))
        rows = []
        for r in merged.to_dict("records"):  # a row only one side has, or a value left empty: None there
            va, vb = (None if is_missing(v) else float(v) for v in (r.get("value_A"), r.get("value_B")))
            flag = r.get("measured_A", r.get("measured"))
            if is_missing(flag):
                flag = r.get("measured_B")
            measured = _is_measured(r["name"], flag, measured_names)
            delta = (vb - va) if va is not None and vb is not None else None
            rel = (delta / abs(va)) if delta is not None and va != 0 else None  # signed: B vs A
            differs = not _same(va, vb) and not measured
            tags = " ".join(f"{k}={r[k]}" for k in keys if k not in ("name", "step") and r[k] != "")
            rows.append({"name": r["name"], "step": r.get("step", ""), "tags": tags, "A": va, "B": vb,
                         "delta": delta, "rel_delta": rel, "measured": measured, "differs": bool(differs)})
        sections["metrics"] = _mark_scaled(pd.DataFrame(rows), sections["config"])
    else:
        sections["metrics"] = pd.DataFrame(columns=["name", "differs"])
    # checks whose pass/fail changed
    cka, ckb = ({r["check"]: r["passed"] if check_applicable(r) else "n/a" for r in d.rows("checks")} for d in (a, b))
    sections["checks"] = pd.DataFrame([
        {"check": k, "A": cka.get(k), "B": ckb.get(k), "differs": not _same(cka.get(k), ckb.get(k))}
        for k in sorted(set(cka) | set(ckb))])
    sections["expectations"] = _diff_expectations(a, b)
    from tfmoe.harness.store.code_capture import diff_code

    sections["code"] = diff_code(a.path, b.path)
    # tensors
    ta, tb = a.tensor_table, b.tensor_table
    rows = []
    names = sorted(set(ta.get("name", [])) | set(tb.get("name", [])))
    for n in names:
        ra = ta[ta["name"] == n].iloc[0] if n in set(ta.get("name", [])) else None
        rb = tb[tb["name"] == n].iloc[0] if n in set(tb.get("name", [])) else None
        row: dict[str, Any] = {"tensor": n}
        if ra is None or rb is None:
            row.update(note="only in " + ("B" if ra is None else "A"), differs=True)
        elif not _same(_shape(ra), _shape(rb)) or not _same(ra["dtype"], rb["dtype"]):
            row.update(note=f"shape/dtype {_shape(ra)} {ra['dtype']} vs {_shape(rb)} {rb['dtype']}", differs=True)
        elif bool(ra["summarised"]) or bool(rb["summarised"]):
            same = all(_same(ra[k], rb[k]) for k in ("min", "max", "mean", "std"))
            row.update(note="summarised: compared min/max/mean/std", differs=not same)
        else:
            x, y = (np.asarray(r["values"], dtype=np.float64) for r in (ra, rb))
            both_nan = np.isnan(x) & np.isnan(y)
            d = np.where(both_nan, 0.0, np.abs(x - y))
            d = np.nan_to_num(d, nan=math.inf)  # one side NaN: infinitely far (an inf difference: the largest float)
            max_abs = float(d.max()) if d.size else 0.0
            scale = float(np.abs(x).max()) if x.size else 0.0
            max_rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
            tol = dtype_tolerance(ra["dtype"], rb["dtype"])
            row.update(max_abs=max_abs, max_rel=max_rel, tolerance=tol, note="", differs=bool(max_rel > tol))
        rows.append(row)
    sections["tensors"] = pd.DataFrame(rows, columns=["tensor", "max_abs", "max_rel", "tolerance", "note", "differs"])
    # timings: ratios only, never "differ"
    tma, tmb = a.timings, b.timings
    trows = []
    if not tma.empty and not tmb.empty:
        for stage in [s for s in tma["stage"].unique() if s in set(tmb["stage"])]:
            wa = float(tma[tma["stage"] == stage]["wall_ms"].iloc[0])
            wb = float(tmb[tmb["stage"] == stage]["wall_ms"].iloc[0])
            trows.append({"stage": stage, "A_ms": wa, "B_ms": wb, "B/A": wb / wa if wa else math.inf, "differs": False})
    sections["timings"] = pd.DataFrame(trows)
    if not all_rows:
        for k, df in sections.items():
            if "differs" in df and k != "timings":
                sections[k] = df[df["differs"]]
    return sections


def _shape(row: pd.Series) -> list[int] | None:
    shape = row.get("shape")
    return None if shape is None or is_missing(shape) else [int(n) for n in shape]


def _diff_expectations(a: RunData, b: RunData) -> pd.DataFrame:
    """Each expectation (by selector and expected) in A and B: held or not, observed; differs when it moved."""
    import pandas as pd

    def keyed(data: RunData) -> dict[tuple[str, str], dict[str, Any]]:
        df = data.expectations
        return {} if df.empty else {(r["selector"], r["expected"]): r for r in df.to_dict("records")}

    ea, eb = keyed(a), keyed(b)
    rows = []
    for key in sorted(set(ea) | set(eb)):
        ra, rb = ea.get(key), eb.get(key)
        held_a, held_b = (None if r is None else r.get("held") for r in (ra, rb))
        obs_a, obs_b = (None if r is None else r.get("observed") for r in (ra, rb))
        moved = ra is None or rb is None or not _same(held_a, held_b) or not _same(obs_a, obs_b)
        rows.append({"expectation": f"{key[0]} {key[1]}", "A_held": held_a, "B_held": held_b, "A": obs_a,
                     "B": obs_b, "differs": bool(moved)})
    return pd.DataFrame(rows, columns=["expectation", "A_held", "B_held", "A", "B", "differs"])


def _pct(x: Any) -> str:
    import pandas as pd

    return "" if x is None or pd.isna(x) else f"{x:+.3g}" if abs(x) >= 10 else f"{100 * x:+.3g} %"


def diff_summary(sections: dict[str, pd.DataFrame], top: int = 3) -> dict[str, Any]:
    """What a person reads first: which config keys differ, how many metrics/tensors/checks differ, the largest."""
    import pandas as pd

    def differing(k: str) -> pd.DataFrame:
        df = sections.get(k, pd.DataFrame())
        return df[df["differs"].astype(bool)] if "differs" in df and len(df) else df.iloc[0:0]

    cfg = differing("config")
    metrics = differing("metrics")
    largest = []
    scaled = metrics[metrics["scaled_by"].astype(str) != ""] if "scaled_by" in metrics else metrics.iloc[0:0]
    if len(metrics) and "rel_delta" in metrics:
        for r in _headline(metrics.drop(index=scaled.index)).head(top).itertuples(index=False):
            where = " ".join(x for x in (f"step {r.step}" if r.step not in ("", None) else "", r.tags) if x)
            largest.append({"metric": r.name, "where": where, "A": r.A, "B": r.B, "rel_delta": r.rel_delta})
    scaled_names = [{"metric": name, "by": str(g["scaled_by"].iloc[0]), "rows": len(g)}
                    for name, g in scaled.groupby("name", sort=True)] if len(scaled) else []
    tensors = differing("tensors")
    worst_tensors = []
    if len(tensors):
        worst = tensors.assign(_k=pd.to_numeric(tensors["max_rel"], errors="coerce").fillna(math.inf)).sort_values(
            "_k", ascending=False)
        worst_tensors = [{"tensor": r.tensor, "max_rel": r.max_rel, "note": r.note}
                         for r in worst.head(top).itertuples(index=False)]
    return {
        "config_keys": [{"key": r.key, "A": r.A, "B": r.B} for r in cfg.itertuples(index=False)],
        "metrics_differ": len(metrics), "metrics_total": len(sections.get("metrics", [])),
        "tensors_differ": len(tensors), "tensors_total": len(sections.get("tensors", [])),
        "checks_differ": len(differing("checks")), "checks_total": len(sections.get("checks", [])),
        "environment_keys": list(differing("environment")["key"]) if len(differing("environment")) else [],
        "largest_metric_changes": largest, "largest_tensor_changes": worst_tensors,
        "scaled_with_config": scaled_names,
    }


def _print_summary(summary: dict[str, Any]) -> None:
    keys = summary["config_keys"]
    cfg = ", ".join(f"{k['key']}: {k['A']} -> {k['B']}" for k in keys[:8]) + (" …" if len(keys) > 8 else "")
    if summary.get("config_missing"):
        print(f"config missing in {' and '.join(summary['config_missing'])} (.hydra/config.yaml): configs not "
              "compared; the verdict rests on the metrics, tensors and checks")
    else:
        print(f"config: {len(keys)} key(s) differ{' (' + cfg + ')' if keys else ''}")
    print(f"differ: {summary['metrics_differ']} of {summary['metrics_total']} metric rows, "
          f"{summary['tensors_differ']} of {summary['tensors_total']} tensors, "
          f"{summary['checks_differ']} of {summary['checks_total']} checks"
          + (f"; environment: {', '.join(summary['environment_keys'])}" if summary["environment_keys"] else ""))
    for m in summary.get("scaled_with_config", []):
        print(f"  scales with the config, not headlined: {m['metric']} ({m['rows']} row(s), {m['by']})")
    for m in summary["largest_metric_changes"]:
        where = f" ({m['where']})" if m["where"] else ""
        change = _pct(m["rel_delta"]) or ("only in B" if is_missing(m["A"]) else "only in A" if is_missing(m["B"])
                                          else "from 0")
        print(f"  largest: {m['metric']}{where} {cell(m['A'])} -> {cell(m['B'])} ({change})")
    for t in summary["largest_tensor_changes"]:
        print(f"  tensor: {t['tensor']} max_rel {cell(t['max_rel'])}{' ' + t['note'] if t['note'] else ''}")


def _focus(sections: dict[str, pd.DataFrame], metric: str | None, top: int | None, keep: bool = False) -> Any:
    """Keep only ``metric`` (a name or glob) in the metrics section and the ``top`` largest rows of each (in
    place); returns how many rows each section left out (``keep``: the narrowed sections instead)."""
    import fnmatch

    import pandas as pd

    hidden: dict[str, int] = {}
    m = sections.get("metrics")
    if metric is not None and m is not None and "name" in m:
        sections["metrics"] = m[[fnmatch.fnmatchcase(str(n), metric) for n in m["name"]]]
    if keep:
        return sections
    if top is None:
        return hidden
    for k, df in sections.items():
        if len(df) <= top:
            continue
        key = {"metrics": "rel_delta", "tensors": "max_rel"}.get(k)
        if key in df:
            df = df.loc[pd.to_numeric(df[key], errors="coerce").abs().fillna(math.inf).sort_values(ascending=False).index]
        hidden[k] = len(df) - top
        sections[k] = df.head(top)
    return hidden


def _config_ratios(config: pd.DataFrame) -> list[tuple[str, float, str]]:
    """(key, B/A, 'key A -> B') of each numeric config key that changed between two non-zero values."""
    out = []
    if config is None or config.empty or "differs" not in config:
        return out
    for r in config[config["differs"].astype(bool)].itertuples(index=False):
        try:
            a, b = float(r.A), float(r.B)
        except (TypeError, ValueError):
            continue
        if a != 0 and b != 0 and math.isfinite(a) and math.isfinite(b):
            out.append((str(r.key), b / a, f"{r.key} {r.A} -> {r.B}: x{b / a:.4g}"))
    return out


SCALE_RTOL = 1e-4  # a row "scales with" a coefficient when B/A equals the coefficient's ratio this closely


def _mark_scaled(metrics: pd.DataFrame, config: pd.DataFrame) -> pd.DataFrame:
    """``scaled_by``: for a differing row whose B/A is exactly a changed numeric config key's B/A (a reported loss
    that includes its coefficient: balance_loss with aux_loss_coef 0.01 -> 0.1, every row x10), that key's
    change; '' otherwise. Such a row still differs (it is reported), but it is no headline."""
    ratios = _config_ratios(config)
    marks = []
    for r in metrics.itertuples(index=False):
        mark = ""
        if r.differs and ratios and r.A not in (None, 0.0) and r.B is not None:
            ratio = r.B / r.A
            mark = next((said for _, k, said in ratios if math.isclose(ratio, k, rel_tol=SCALE_RTOL)), "")
        marks.append(mark)
    return metrics.assign(scaled_by=marks)


def _headline(metrics: pd.DataFrame) -> pd.DataFrame:
    """The differing metric rows a reader should see first: one per series (name + tags), its last step (where
    a run ends up, not each step on the way), the series ranked by that row's relative change (rows only one run
    has last)."""
    import pandas as pd

    if metrics.empty:
        return metrics
    steps = pd.to_numeric(metrics["step"], errors="coerce").fillna(-1) if "step" in metrics else 0
    last = metrics.assign(_s=steps).sort_values("_s", kind="stable").groupby(["name", "tags"], sort=False).tail(1)
    order = pd.to_numeric(last["rel_delta"], errors="coerce").abs().fillna(-1).sort_values(ascending=False, kind="stable")
    return last.loc[order.index].drop(columns=["_s"])


def _measured_changes(metrics: pd.DataFrame) -> pd.DataFrame:
    """The machine-measured metric rows whose value moved, largest relative change first (context of a diff)."""
    import pandas as pd

    if metrics.empty or "measured" not in metrics:
        return pd.DataFrame(columns=["name", "step", "tags", "A", "B", "rel_delta"])
    rows = metrics[metrics["measured"].astype(bool)]
    moved = [not _same(x, y) for x, y in zip(rows["A"], rows["B"], strict=True)]
    rows = rows.loc[pd.Series(moved, index=rows.index, dtype=bool)]
    order = pd.to_numeric(rows["rel_delta"], errors="coerce").abs().fillna(math.inf).sort_values(ascending=False)
    return rows.loc[order.index, ["name", "step", "tags", "A", "B", "rel_delta"]]


def diff(ref_a: str, ref_b: str, runs_root: Path, all_rows: bool, force: bool, fmt: str,
         metric: str | None = None, top: int | None = None) -> int:
    """Print what differs between two runs: a summary first, then each section (``--metric``, ``--top`` narrow it;
    tables show the 20 largest rows per section unless ``--top``/``--all`` say otherwise). Exit 1 when anything
    but environment and timings differs."""
    import pandas as pd

    a = load_run(resolve_run(ref_a, runs_root))
    b = load_run(resolve_run(ref_b, runs_root))
    if a.run["experiment"] != b.run["experiment"] and not force:
        raise BadInput(f"runs of different experiments ({a.run['experiment']} vs {b.run['experiment']}): "
                       "pass --force to compare anyway")
    if top is not None and top < 1:
        raise BadInput(f"--top {top}: pass a positive number of rows")
    everything = diff_runs(a, b, True)
    # environment and timings are context: shown, but a replay on a newer commit can still "reproduce"
    judged = [k for k, df in everything.items()
              if k not in ("timings", "environment") and "differs" in df and len(df) and bool(df["differs"].any())]
    differs = bool(judged)
    focused = {k: df if all_rows or k == "timings" or "differs" not in df else df[df["differs"].astype(bool)]
               for k, df in everything.items()}
    if metric is not None:
        everything["metrics"] = _focus(dict(everything), metric, None, keep=True)["metrics"]
    hidden = _focus(focused, metric, top if top is not None else None if fmt == "json" or all_rows else 20)
    summary = diff_summary(everything)
    summary["config_missing"] = [side for side, d in (("A", a), ("B", b)) if d.config_missing]
    context = _measured_changes(everything.get("metrics", pd.DataFrame()))
    if fmt == "json":
        print(json.dumps({"A": str(a.path), "B": str(b.path), "differs": differs, "summary": summary,
                          **{k: df.to_dict("records") for k, df in focused.items()},
                          "context": context.to_dict("records")}, default=_jsonable))
        return 1 if differs else 0
    print(f"A: {a.path}\nB: {b.path}")
    _print_summary(summary)
    if len(context):  # machine measurements moved: listed, never judged
        names = sorted(set(context["name"]))
        print(f"context, not judged: {len(context)} machine-measured metric rows changed ("
              + ", ".join(names[:8]) + (" …" if len(names) > 8 else "") + "), with environment and timings")
    if all_rows or top is not None:
        sections = focused
    else:  # the measured rows are not in "metrics" (they never differ): shown in a context section instead
        sections = {**focused, "context, not judged: machine measurements": context.head(20)}
    for k, df in sections.items():
        if len(df):
            shown = df
            if not all_rows and k != "timings":  # every row shown differs: the column says nothing
                shown = shown.drop(columns=["differs"], errors="ignore")
            if "measured" in shown and not shown["measured"].any():
                shown = shown.drop(columns=["measured"])
            title = k + (" (context, not judged)" if k in ("environment", "timings") else "")
            title += f" ({hidden[k]} more rows: --top N, --all)" if hidden.get(k) else ""
            if k.startswith("context") and len(context) > len(df):
                title += f" (the 20 largest of {len(context)}: --all)"
            print_frame(shown, fmt, title)
    print(f"differ: {', '.join(judged)}" if differs else
          "no differences beyond tolerance (environment, timings and machine measurements are context only)")
    return 1 if differs else 0


def complete_sweep(sweep_dir: Path) -> int:
    """`tfmoe sweep-complete DIR`: write sweep.parquet (and sweep plots) for a sweep whose launching process died,
    print its jobs, and return the exit code the sweep would have had (a job not started counts as interrupted)."""
    from tfmoe.contract.errors import BadInput
    from tfmoe.harness.store.rundir import RUN_FILE
    from tfmoe.harness.store.sweeps import has_unstarted_jobs, sweep_experiment, write_sweep_outputs

    sweep_dir = Path(sweep_dir)
    if not sweep_dir.is_dir():
        raise BadInput(f"{sweep_dir} is not a directory: pass a sweep directory, runs/<experiment>/multirun-<...>")
    experiment = sweep_experiment(sweep_dir)
    write_sweep_outputs(sweep_dir, experiment)
    dirs = sorted((p.parent for p in sweep_dir.glob(f"*/{RUN_FILE}")), key=lambda p: (len(p.name), p.name))
    if dirs:
        print_outcome(dirs, [sweep_dir])
    else:
        print_sweep_lines([sweep_dir])
    codes = [exit_code_of(dirs)] if dirs else []
    if has_unstarted_jobs(sweep_dir):
        codes.append(Status.NOT_STARTED.exit_code)
    return worst_exit_code(codes)
