"""The `tfmoe` command line: one subcommand per experiment plus the notebook commands.

The CLI only wires: Hydra composes and launches (runner.execute), notebook.py does disk I/O,
reports.py/failures.py format. torch is imported only when an experiment actually runs.

No ``from __future__ import annotations`` here: Typer reads each command's ``Annotated[...]`` parameters, and
string annotations would be eval'd again for every command each time the CLI starts (~2x slower `--help`).
"""

import contextlib
import sys
from collections.abc import Iterator
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer
from typer._click.exceptions import ClickException, NoArgsIsHelpError, UsageError  # typer vendors click
from typer.core import TyperGroup

from tfmoe.contract.errors import BadInput, Terminated, raise_terminated
from tfmoe.contract.registry import EXPERIMENTS, Experiment
from tfmoe.contract.status import Status, worst_exit_code


class OneLineErrors(TyperGroup):
    """The top-level group: a usage error (an unknown option, ``--dtype fp8``) is one line on stderr, exit 2, like
    every other bad input (click prints a usage block and a hint); Ctrl-C or SIGTERM that reaches the CLI says so
    on stderr (typer would exit 130 without a word)."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except NoArgsIsHelpError as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except UsageError as exc:
            where = f" (see `{exc.ctx.command_path} --help`)" if exc.ctx is not None else ""
            typer.echo(f"error: {' '.join(exc.format_message().split())}{where}", err=True)
            sys.exit(Status.ERROR.exit_code)
        except ClickException as exc:
            typer.echo(f"error: {' '.join(exc.format_message().split())}", err=True)
            sys.exit(exc.exit_code)
        except typer.Abort:
            typer.echo("interrupted", err=True)
            sys.exit(Status.INTERRUPTED.exit_code)
        sys.exit(code if isinstance(code, int) else 0)

    def invoke(self, ctx: typer.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            raise typer.Exit(Status.INTERRUPTED.exit_code) from None
        except Terminated as exc:
            typer.echo(str(exc), err=True)
            raise typer.Exit(exc.exit_code) from None


app = typer.Typer(
    cls=OneLineErrors,
    name="tfmoe",
    help="A lab notebook for Transformer & MoE claims: every experiment leaves a parquet run directory.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
)
failures_app = typer.Typer(help="The failures log (failures.md): add an entry from a run, or list entries.",
                           no_args_is_help=True)
app.add_typer(failures_app, name="failures")
export_app = typer.Typer(help="Copy runs into other tools' stores.", no_args_is_help=True)
app.add_typer(export_app, name="export")


class DType(str, Enum):
    fp32 = "fp32"
    fp16 = "fp16"
    bf16 = "bf16"
    fp64 = "fp64"


class Format(str, Enum):
    table = "table"
    md = "md"
    json = "json"


def fail(message: str) -> typer.Exit:
    """One clear line on stderr, exit 2."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(Status.ERROR.exit_code)


@contextlib.contextmanager
def bad_input_exits_2() -> Iterator[None]:
    """Turn a BadInput raised inside the block into one line on stderr and exit code 2."""
    try:
        yield
    except BadInput as exc:
        raise fail(str(exc)) from None


def _reading(read: Any, runs_root: Path) -> Any:
    """A notebook reader that still answers when the disk fills under the run catalog (catalog.read_through_full_disk)."""
    from tfmoe.harness.store.catalog import read_through_full_disk

    return read_through_full_disk(read, runs_root)


# Typer's Annotated style: the type and the option together, the default as the parameter's own default
RunsRoot = Annotated[Path, typer.Option("--runs-root", help="Where the runs live (default: ./runs).")]
DEFAULT_RUNS_ROOT = Path("runs")
Device = Annotated[str | None, typer.Option("--device", help="cpu | cuda | cuda:N | mps | auto")]


# ------------------------------------------------------------------------------------------ experiments
def _experiment_command(exp: Experiment):
    def command(
        ctx: typer.Context,
        device: Device = None,
        dtype: Annotated[DType | None, typer.Option("--dtype", help="Floating-point dtype of the run.")] = None,
        seed: Annotated[int | None, typer.Option("--seed", help="Seed for torch/numpy/random.")] = None,
        multirun: Annotated[bool, typer.Option("-m", "--multirun",
                                               help="Hydra multirun: sweep comma lists / range().")] = False,
        expect: Annotated[list[str] | None, typer.Option(
            "--expect", help='Your prediction, judged by the run: "METRIC OP VALUE", e.g. "cv < 0.1" '
                             '(repeatable; exit 4 if it misses).')] = None,
    ) -> None:
        from tfmoe.harness.launching.launch import run_experiment

        typed = []
        for key, value in (("device", device), ("dtype", dtype.value if dtype else None), ("seed", seed)):
            if value is None:
                continue
            given = [a for a in ctx.args if a.split("=", 1)[0].lstrip("+~") == key]
            if any(a.split("=", 1)[-1] != str(value) for a in given):  # neither silently wins: you choose
                raise fail(f"--{key} {value} and {given[0]} both set {key}: pass one of them (an option and an "
                           f"override of the same key are never merged)")
            if not given:
                typed.append(f"{key}={value}")
        with bad_input_exits_2():
            if expect:
                from tfmoe.harness.method.expectations import cli_override

                typed += cli_override(expect)
            code = run_experiment(exp, [*ctx.args, *typed], multirun=multirun)
        raise typer.Exit(code)

    command.__doc__ = (
        f"{exp.help}\n\nConfig: conf/{exp.config}.yaml. Extra arguments are Hydra overrides (key=value); "
        "Hydra's --cfg job / --info work too."
    )
    return command


for _exp in EXPERIMENTS.values():
    app.command(
        name=_exp.name,
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    )(_experiment_command(_exp))


@app.command("all")
def run_all(device: Device = None, runs_root: RunsRoot = DEFAULT_RUNS_ROOT) -> None:
    """Run every registered experiment with its defaults, then print a table of the runs made."""
    from tfmoe.harness.launching.launch import run_experiment
    from tfmoe.harness.reading.reports import print_runs_table

    codes, made = [], []
    for exp in EXPERIMENTS.values():
        typer.echo(f"== tfmoe {exp.name}", err=True)
        args = [f"run_root={runs_root}"] + ([f"device={device}"] if device else [])
        try:
            codes.append(run_experiment(exp, args, multirun=False, quiet=True, made=made))
        except BadInput as exc:
            typer.echo(f"error: {exc}", err=True)
            codes.append(Status.ERROR.exit_code)
    print_runs_table(made)
    raise typer.Exit(worst_exit_code(codes))


# ------------------------------------------------------------------------------------------ notebook
@app.command("runs")
def runs_cmd(
    experiment: Annotated[str | None, typer.Option("--experiment", "-e", help="Only this experiment.")] = None,
    status: Annotated[str | None, typer.Option(
        "--status", help="ok | failed | unexpected | error | interrupted | crashed | running | lost | unreadable")] = None,
    last: Annotated[int | None, typer.Option("--last", help="Only the N most recent runs.")] = None,
    fmt: Annotated[Format, typer.Option("--format")] = Format.table,
    runs_root: RunsRoot = DEFAULT_RUNS_ROOT,
) -> None:
    """List runs: id, experiment, status, started, wall, device, dtype, overrides."""
    from tfmoe.harness.reading import listing

    if experiment is not None and experiment not in EXPERIMENTS:
        raise fail(f"unknown experiment {experiment!r}: choose one of {', '.join(EXPERIMENTS)}")
    if last is not None and last < 1:
        raise fail(f"--last {last}: pass a positive number")
    if status is not None:
        try:
            Status.parse(status)
        except ValueError as exc:
            raise fail(f"--status {exc}") from None
    with bad_input_exits_2():
        _reading(lambda: listing.runs(runs_root, experiment, status, last, fmt.value), runs_root)


@app.command("show")
def show_cmd(
    run: Annotated[str, typer.Argument(help="Run path, run id, unique prefix, or 'latest'.")],
    fmt: Annotated[Format, typer.Option("--format")] = Format.table,
    full_width: Annotated[bool, typer.Option(
        "--full-width", help="Each table at its natural width (default: fit the terminal, or 120 columns "
                             "when the output is a file or a pipe; COLUMNS sets another).")] = False,
    runs_root: RunsRoot = DEFAULT_RUNS_ROOT,
) -> None:
    """One run: config, environment, checks, metrics, timings, tensors, plots."""
    from tfmoe.harness.reading import reports

    with bad_input_exits_2():
        _reading(lambda: reports.show(run, runs_root, fmt.value, full_width=full_width), runs_root)


@app.command("diff")
def diff_cmd(
    a: Annotated[str, typer.Argument(help="Run A (path, id, prefix or 'latest').")],
    b: Annotated[str, typer.Argument(help="Run B.")],
    all_rows: Annotated[bool, typer.Option("--all", help="Show everything, not only what differs.")] = False,
    force: Annotated[bool, typer.Option("--force", help="Compare runs of different experiments.")] = False,
    metric: Annotated[str | None, typer.Option(
        "--metric", help="Only this metric (a name or a glob like 'loss*').")] = None,
    top: Annotated[int | None, typer.Option(
        "--top", help="The N largest changes per section (tables default to 20).")] = None,
    fmt: Annotated[Format, typer.Option("--format")] = Format.table,
    runs_root: RunsRoot = DEFAULT_RUNS_ROOT,
) -> None:
    """What differs between two runs, summary first. Exit 0: nothing beyond tolerance (timings excluded); 1: it does."""
    from tfmoe.harness.reading import reports

    with bad_input_exits_2():
        code = _reading(lambda: reports.diff(a, b, runs_root, all_rows, force, fmt.value, metric=metric, top=top),
                        runs_root)
    raise typer.Exit(code)


@app.command("replay")
def replay_cmd(
    run: Annotated[str, typer.Argument(help="Run path, id, prefix or 'latest'.")],
    runs_root: RunsRoot = DEFAULT_RUNS_ROOT,
) -> None:
    """Re-run with the recorded config and seed, then diff the new run against the old one."""
    from tfmoe.harness.launching.launch import replay

    with bad_input_exits_2():
        code = replay(run, runs_root)
    raise typer.Exit(code)


class SqlFormat(str, Enum):
    table = "table"
    json = "json"
    csv = "csv"


@app.command("sql")
def sql_cmd(
    query: Annotated[str, typer.Argument(help='One read-only SELECT, e.g. "SELECT run_id, status FROM runs".')],
    fmt: Annotated[SqlFormat, typer.Option(
        "--format", help="table | json (a list of row objects) | csv")] = SqlFormat.table,
    runs_root: RunsRoot = DEFAULT_RUNS_ROOT,
) -> None:
    """Read-only SQL (DuckDB) over every run: views runs, metrics, checks, timings (each with run_id)."""
    from tfmoe.harness.reading import sql

    with bad_input_exits_2():
        sql.emit(_reading(lambda: sql.query(runs_root, query), runs_root), fmt.value)


@export_app.command("mlflow")
def export_mlflow_cmd(
    runs: Annotated[list[str] | None, typer.Argument(
        help="Runs (path, id, prefix, 'latest' or a sweep directory); default all.")] = None,
    tracking_uri: Annotated[str, typer.Option(
        "--tracking-uri", help="MLflow tracking store (default: ./mlflow.db).")] = "sqlite:///mlflow.db",
    runs_root: RunsRoot = DEFAULT_RUNS_ROOT,
) -> None:
    """Export runs to MLflow: params, metrics, tags, artifacts; a sweep becomes a parent run. Idempotent. Exit 1
    when a run was skipped as unreadable (each named on stderr)."""
    from tfmoe.harness.reading import export_mlflow

    with bad_input_exits_2():
        done = _reading(lambda: export_mlflow.export(list(runs or []), runs_root, tracking_uri), runs_root)
        code = export_mlflow.report(done, tracking_uri)
    raise typer.Exit(code)


@app.command("sweep-complete")
def sweep_complete_cmd(
    sweep_dir: Annotated[Path, typer.Argument(help="The sweep directory, runs/<experiment>/multirun-<...>.")],
) -> None:
    """Write sweep.parquet for a sweep whose launching process died (killed, machine lost): every job, with the
    state it is in (ok/failed/.../lost/running/not_started). Exit code: the worst of its jobs'."""
    from tfmoe.harness.reading.reports import complete_sweep

    with bad_input_exits_2():
        code = complete_sweep(sweep_dir)
    raise typer.Exit(code)


@failures_app.command("add")
def failures_add(
    run: Annotated[str, typer.Argument(help="The run that shows the failure (path, id, prefix or 'latest').")],
    title: Annotated[str | None, typer.Option("--title")] = None,
    hypothesis: Annotated[str, typer.Option("--hypothesis")] = "not yet stated",
    fix: Annotated[str, typer.Option("--fix")] = "not yet fixed",
    test: Annotated[str, typer.Option("--test", help="The regression test that guards it.")] = "none yet",
    file: Annotated[Path, typer.Option("--file", help="The failures log (default ./failures.md).")] = Path("failures.md"),
    again: Annotated[bool, typer.Option("--again", help="Log a run that the file already has an entry for.")] = False,
    runs_root: RunsRoot = DEFAULT_RUNS_ROOT,
) -> None:
    """Append an entry to failures.md: phenomenon, hypothesis, evidence, fix, regression test (a --test naming a
    pytest node must name an existing file and test; a run already logged needs --again)."""
    from tfmoe.harness.method import failures

    with bad_input_exits_2():
        entry_title = failures.add(run, runs_root, file, title, hypothesis, fix, test, again)
    typer.echo(f"appended to {file}: {entry_title}")


class ClaimsFormat(str, Enum):
    table = "table"
    json = "json"


@app.command("claims")
def claims_cmd(
    run: Annotated[bool, typer.Option("--run", help="Run each claim's experiment and judge its check(s).")] = False,
    only: Annotated[list[str] | None, typer.Option("--claim", help="Only this claim (its key; repeatable).")] = None,
    fmt: Annotated[ClaimsFormat, typer.Option("--format")] = ClaimsFormat.table,
    runs_root: RunsRoot = DEFAULT_RUNS_ROOT,
) -> None:
    """The chapter's seven claims (six self-test, one expert-parallel): experiment, overrides and the check(s)
    that would fail were each false."""
    from tfmoe.harness.launching import claims

    if not run:
        claims.print_list(fmt.value)
        return
    with bad_input_exits_2():
        code = claims.run_all(runs_root, only)
    raise typer.Exit(code)


@app.command("conclude")
def conclude_cmd(
    run: Annotated[str, typer.Argument(help="The run the conclusion is about (path, id, prefix or 'latest').")],
    proven: Annotated[list[str] | None, typer.Option(
        "--proven", help="What a check or a number of this run shows.")] = None,
    inferred: Annotated[list[str] | None, typer.Option(
        "--inferred", help="What you infer beyond what it shows.")] = None,
    unverified: Annotated[list[str] | None, typer.Option("--unverified", help="What is not yet verified.")] = None,
    runs_root: RunsRoot = DEFAULT_RUNS_ROOT,
) -> None:
    """Append conclusions (never rewriting earlier ones) to the run's conclusions.parquet and summary.md."""
    from tfmoe.harness.method import conclusions

    entries = [("proven", t) for t in proven or []] + [("inferred", t) for t in inferred or []] + \
        [("unverified", t) for t in unverified or []]
    with bad_input_exits_2():
        run_dir, rows = conclusions.append(run, runs_root, entries)
    typer.echo(f"{run_dir}/{conclusions.CONCLUSIONS_FILE}: {len(rows)} conclusion(s), {len(entries)} new")


@failures_app.command("list")
def failures_list(file: Annotated[Path, typer.Option("--file")] = Path("failures.md")) -> None:
    """List the entries of failures.md."""
    from tfmoe.harness.method import failures

    with bad_input_exits_2():
        failures.list_entries(file)


def main() -> None:
    import signal

    signal.signal(signal.SIGTERM, raise_terminated)  # SIGTERM (kill, SLURM's time limit) ends like Ctrl-C
    try:
        app()
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(Status.INTERRUPTED.exit_code)
    except Terminated as exc:
        typer.echo(str(exc), err=True)
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
