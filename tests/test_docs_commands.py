"""Every command shown in README.md and docs/*.md is run, so that none goes stale.

The commands are read from the files: each line of a fenced ``bash`` block, each ``$ `` line of a ``console`` block
(with the ``error:`` line it shows, if any), each inline `` `tfmoe …` `` span, and the ``python`` blocks. Then:

- notebook commands (runs, show, diff, replay, sql, failures, conclude, export, claims, sweep-complete, --help) run
  for real, in document order, against a small real runs directory made here; RUN / RUN_A / RUN_B / `<…>` and the
  run ids the docs name are replaced by this directory's run ids and sweep;
- experiment commands go through the CLI's whole validation (TFMOE_VALIDATE_ONLY=1: overrides, expectations, every
  job's settings(cfg), Hydra's flags) in the default suite, and run for real in the `slow` test (SLURM ones under
  the `cluster` marker, Ray ones where the plugin is installed, `--device cuda` ones only with CUDA);
- an inline mention of a bare subcommand (`tfmoe conclude`) runs its --help; make targets run as `make -n`, pip
  extras must exist in pyproject.toml, scripts run with their documented arguments, benchmark scripts compile,
  `mlflow ui` parses its options, python blocks compile (a block headed ``# NAME.py`` is the file a command imports,
  the others run against the runs directory).

``check`` returns None for a command that works and the problem otherwise; the planted-bug tests below feed it
documented commands with a bogus key or option and see it fail.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tfmoe.contract.registry import EXPERIMENTS

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
NOTEBOOK = {"runs", "show", "diff", "replay", "sql", "failures", "conclude", "export", "claims", "sweep-complete",
            "--help"}
MADE_BY_SETUP = (Path(sys.prefix) / ".installed").exists()  # a venv `make setup` made from the lock
GROUPS = {"failures", "export"}  # subcommands with subcommands of their own
RUN_ID = re.compile(r"\b\d{8}T\d{6}Z-[0-9a-f]{8}(?:-\d+)?\b")
HEADED = re.compile(r"^# ([\w.]+\.py)\n")


@dataclass(frozen=True)
class Command:
    where: str  # file:line
    text: str  # as written (continuations joined)
    argv: tuple[str, ...]  # shell words, comments dropped
    env: tuple[tuple[str, str], ...] = ()
    error: str | None = None  # the `error: …` line a console block shows after it
    inline: bool = False

    @property
    def kind(self) -> str:
        if not self.argv:
            return "empty"
        head = self.argv[0]
        if head == "tfmoe":
            sub = self.argv[1] if len(self.argv) > 1 else "--help"
            if self.inline and sub != "--help" and all(re.fullmatch(r"[a-z][a-z-]*", w) for w in self.argv[1:3]) \
                    and len(self.argv) <= (3 if sub in GROUPS else 2):
                return "mention"  # a subcommand named in prose: its --help must work
            if sub == "claims" and "--run" in self.argv:
                return "experiment"
            if sub in EXPERIMENTS or sub == "all":
                return "experiment"
            return "notebook"
        return {"make": "make", "pip": "pip", "python": "python", "bash": "bash", "mlflow": "mlflow"}.get(head, head)

    @property
    def launcher(self) -> str:
        for word in self.argv:
            if word.startswith("hydra/launcher="):
                return word.split("=", 1)[1]
        return "basic"

    @property
    def cuda(self) -> bool:
        words = " ".join(self.argv)
        return bool(re.search(r"(--device[ =]|device=)cuda", words)) or self.argv[:2] == ("bash", "benchmarks/cuda_check.sh")


@dataclass
class Doc:
    path: Path
    commands: list[Command] = field(default_factory=list)
    python: list[tuple[str, str]] = field(default_factory=list)  # (where, source)


def _words(text: str) -> list[str]:
    lexer = shlex.shlex(text, posix=True, punctuation_chars=False)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    return list(lexer)


def _complete(text: str) -> bool:
    try:
        _words(text)
    except ValueError:  # an open quote: the command goes on on the next line
        return False
    return not text.rstrip().endswith("\\")


def _command(where: str, text: str, error: str | None = None, inline: bool = False) -> Command | None:
    words = _words(text.replace("\\\n", " "))
    env = []
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        key, _, value = words.pop(0).partition("=")
        env.append((key, value))
    if not words:
        return None
    return Command(where, " ".join(text.split()), tuple(words), tuple(env), error, inline)


def parse(path: Path, root: Path = REPO) -> Doc:
    """The commands and python blocks of one markdown file."""
    doc = Doc(path)
    name = path.relative_to(root).as_posix()
    lines = path.read_text(encoding="utf-8").splitlines()
    i, prose = 0, []
    while i < len(lines):
        fence = re.match(r"^(\s*)```(\w*)\s*$", lines[i])
        if not fence:
            prose.append((i + 1, lines[i]))
            i += 1
            continue
        indent, lang, start = fence.group(1), fence.group(2), i + 1
        j = i + 1
        while not re.match(rf"^{indent}```\s*$", lines[j]):
            j += 1
        body = [line[len(indent):] if line.startswith(indent) else line for line in lines[i + 1:j]]
        i = j + 1
        if lang == "python":
            doc.python.append((f"{name}:{start}", textwrap.dedent("\n".join(body)) + "\n"))
        elif lang in ("bash", "console"):
            k = 0
            while k < len(body):
                line = body[k]
                if lang == "console" and not line.startswith("$ "):
                    k += 1
                    continue
                text, first = (line[2:] if lang == "console" else line), k
                while not _complete(text) and k + 1 < len(body):
                    k += 1
                    text += "\n" + body[k]
                k += 1
                error = None
                if lang == "console":
                    output = []
                    while k < len(body) and not body[k].startswith("$ "):
                        output.append(body[k])
                        k += 1
                    error = next((o for o in output if o.startswith("error:")), None)
                if text.strip() and not text.lstrip().startswith("#"):
                    cmd = _command(f"{name}:{start + first + 1}", text, error)
                    if cmd:
                        doc.commands.append(cmd)
    for number, line in prose:
        for span in re.findall(r"`(tfmoe [^`]+)`", line):
            cmd = _command(f"{name}:{number}", span, inline=True)
            if cmd:
                doc.commands.append(cmd)
    return doc


def all_docs() -> list[Doc]:
    return [parse(p) for p in DOCS]


# ------------------------------------------------------------------------------------------ substitution
@dataclass
class Notebook:
    """A small real runs directory: two shift-labels runs (right and left padding), one whose expectation missed,
    and a two-job sweep."""

    cwd: Path
    a: str
    b: str
    unexpected: str
    sweep: Path


def substitute(argv: tuple[str, ...], nb: Notebook, named: dict[str, str]) -> list[str]:
    """Placeholders and the docs' own run ids -> this notebook's runs (the docs' ids in order of first mention)."""
    run = nb.unexpected if argv[1:3] == ("failures", "add") else nb.a  # failures add refuses a run that went well
    ids = {"RUN": run, "RUN_A": nb.a, "RUN_B": nb.b, "ID": run, "PREFIX": run[:12], "DIR": str(nb.sweep)}
    out = []
    for word in argv:
        for found in RUN_ID.findall(word):
            if found not in named:
                named[found] = [nb.a, nb.b][min(len(named), 1)]
            word = word.replace(found, named[found])
        word = ids.get(word, word)
        out.append(re.sub(r"runs/[\w-]+/multirun-<…>", str(nb.sweep), word))
    return out


# ------------------------------------------------------------------------------------------ running
def _cli(argv: list[str], cwd: Path, env: dict[str, str]) -> tuple[int, str, str]:
    """`tfmoe ARGV` in-process (typer's CliRunner), with ``env`` set for the call."""
    from tfmoe.api.testing import run_cli

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        result = run_cli(argv, cwd)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return result.exit_code, result.stdout, result.stderr


def _allowed(cmd: Command) -> set[int]:
    """The exit codes a working command may give: diff 1 when something differs, an expectation may miss (4)."""
    codes = {0}
    if cmd.argv[:2] == ("tfmoe", "diff"):
        codes.add(1)
    if any("expect" in w for w in cmd.argv):
        codes.add(4)
    return codes


def check(cmd: Command, nb: Notebook, named: dict[str, str], real: bool = False) -> str | None:
    """Run one documented command the way its kind calls for; None when it works, else what went wrong."""
    kind = cmd.kind
    where = f"{cmd.where}: {cmd.text}"
    if kind == "mention":
        code, out, err = _cli([*cmd.argv[1:], "--help"], nb.cwd, {})
        return None if code == 0 else f"{where}: `{cmd.text} --help` exited {code}: {err.strip()[-300:]}"
    if kind in ("notebook", "experiment"):
        argv = substitute(cmd.argv, nb, named)[1:]
        env = dict(cmd.env)
        if kind == "experiment" and not real:
            if argv[0] == "claims":  # `claims --run` launches experiments: its option must parse
                argv = [*argv, "--help"]
            else:
                env["TFMOE_VALIDATE_ONLY"] = "1"
        if real and kind == "experiment":
            proc = subprocess.run([sys.executable, "-m", "tfmoe.cli", *argv], cwd=nb.cwd, capture_output=True,
                                  text=True, timeout=900, env={**os.environ, **env, "COLUMNS": "200",
                                                               "RAY_USAGE_STATS_ENABLED": "0"})
            code, out, err = proc.returncode, proc.stdout, proc.stderr
        else:
            code, out, err = _cli(argv, nb.cwd, env)
        if cmd.error is not None:
            if code != 2 or cmd.error not in err:
                return f"{where}: expected exit 2 and {cmd.error!r}, got exit {code}: {err.strip()[-300:]}"
            return None
        if code not in _allowed(cmd):
            return f"{where}: exit {code}: {(err or out).strip()[-400:]}"
        return None
    if kind == "srun":  # `srun -n W tfmoe …`: the tfmoe command, validated as task 0 of a W-task srun step would
        words, tasks = list(cmd.argv[1:]), 1  # (make test-cluster runs the form for real, under sbatch)
        while words and words[0].startswith("-"):
            flag, _, value = words.pop(0).partition("=")
            if not value and flag in ("-n", "--ntasks", "-N", "--nodes", "-c", "--cpus-per-task"):
                value = words.pop(0)
            tasks = int(value) if flag in ("-n", "--ntasks") else tasks
        step = {"SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": str(tasks),
                "SLURM_NTASKS": str(tasks)}
        inner = Command(cmd.where, cmd.text, tuple(words), (*cmd.env, *step.items()), cmd.error)
        if inner.kind != "experiment":
            return f"{where}: srun here starts a tfmoe experiment's tasks, not {' '.join(words[:2])!r}"
        return check(inner, nb, named)
    if kind == "make":
        proc = subprocess.run(["make", "-n", *cmd.argv[1:]], cwd=REPO, capture_output=True, text=True, timeout=60)
        return None if proc.returncode == 0 else f"{where}: make -n exited {proc.returncode}: {proc.stderr.strip()}"
    if kind == "pip":
        import tomllib

        extras = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])
        asked = {e for w in cmd.argv for m in re.finditer(r"\.\[([\w,-]+)\]", w) for e in m.group(1).split(",")}
        if cmd.argv[1:3] != ("install", "-e") or not asked:
            return f"{where}: only `pip install -e '.[EXTRAS]'` is documented here"
        unknown = asked - extras
        return f"{where}: unknown extra(s) {sorted(unknown)}" if unknown else None
    if kind == "python":
        if cmd.argv[1] == "-c":
            proc = subprocess.run([sys.executable, *cmd.argv[1:]], cwd=nb.cwd, capture_output=True, text=True,
                                  timeout=120)
            return None if proc.returncode == 0 else f"{where}: exit {proc.returncode}: {proc.stderr[-400:]}"
        script = REPO / cmd.argv[1]
        if not script.is_file():
            return f"{where}: no such file {cmd.argv[1]}"
        if cmd.argv[1].startswith("benchmarks/"):  # make bench runs them; here they must at least compile
            compile(script.read_text(encoding="utf-8"), str(script), "exec")
            return None
        proc = subprocess.run([sys.executable, str(script), *cmd.argv[2:]], cwd=REPO, capture_output=True, text=True,
                              timeout=120)
        if proc.returncode == 1 and script.name == "check_lock.py" and not MADE_BY_SETUP:
            return None  # an environment of your own may differ from the lock (tests/test_lock.py says how)
        return None if proc.returncode == 0 else f"{where}: exit {proc.returncode}: {proc.stderr[-400:]}"
    if kind == "bash":
        script = REPO / cmd.argv[1]
        if not script.is_file():
            return f"{where}: no such file {cmd.argv[1]}"
        proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
        return None if proc.returncode == 0 else f"{where}: bash -n: {proc.stderr.strip()}"
    if kind == "mlflow":
        from click.testing import CliRunner
        from mlflow.cli import cli

        result = CliRunner().invoke(cli, [*cmd.argv[1:], "--help"])
        return None if result.exit_code == 0 else f"{where}: mlflow exited {result.exit_code}: {result.output[-300:]}"
    return f"{where}: no rule runs a `{kind}` command: add one to tests/test_docs_commands.py"


def run_python_block(where: str, source: str, nb: Notebook, named: dict[str, str]) -> str | None:
    """A python block: compiled; one without a ``# NAME.py`` header runs in the notebook's directory."""
    try:
        compile(source, where, "exec")
    except SyntaxError as exc:
        return f"{where}: {exc}"
    if HEADED.match(source) or "MyLayer" in source or "class Settings" in source:
        return None  # a file a command imports, or a shape to fill in (the how-to runs in test_add_an_experiment)
    text = source.replace("<run>", nb.a).replace("multirun-<…>", nb.sweep.name)
    old = os.getcwd()
    os.chdir(nb.cwd)
    try:
        exec(compile(text, where, "exec"), {"__name__": "__docs__"})
    except Exception as exc:
        return f"{where}: {type(exc).__name__}: {exc}"
    finally:
        os.chdir(old)
    return None


def write_files(docs: list[Doc], cwd: Path) -> None:
    """The files the documented commands import: headed python blocks, and tests/adapted_attention.py."""
    for doc in docs:
        for _, source in doc.python:
            m = HEADED.match(source)
            if m:
                (cwd / m.group(1)).write_text(source, encoding="utf-8")
    shutil.copy(REPO / "tests" / "adapted_attention.py", cwd / "adapted_attention.py")


# ------------------------------------------------------------------------------------------ fixtures
def make_notebook(cwd: Path) -> Notebook:
    from tfmoe.api.testing import launched

    exp = EXPERIMENTS["shift-labels"]
    old = os.getcwd()
    os.chdir(cwd)
    try:
        code_a, (a,) = launched(exp, ["++expect.p='padding_invariance_max_abs < 1e-6'"])
        code_b, (b,) = launched(exp, ["pad_side=left"])
        code_u, (u,) = launched(exp, ["++expect.p='loss < 0'"])
        code_s, jobs = launched(exp, ["seed=0,1", "threads=1"], multirun=True)
    finally:
        os.chdir(old)
    assert (code_a, code_b, code_u, code_s) == (0, 0, 4, 0)
    return Notebook(cwd, a.name, b.name, u.name, jobs[0].parent)


@pytest.fixture(scope="module")
def notebook(tmp_path_factory: pytest.TempPathFactory) -> Notebook:
    cwd = tmp_path_factory.mktemp("docs-notebook")
    write_files(all_docs(), cwd)
    (cwd / "tests").symlink_to(REPO / "tests")  # `failures add --test` names a real test of the checkout
    return make_notebook(cwd)


# ------------------------------------------------------------------------------------------ tests
def test_the_docs_show_commands_of_every_kind() -> None:
    docs = all_docs()
    by_file = {d.path.name: len(d.commands) for d in docs}
    assert all(by_file[name] > 0 for name in ("README.md", "using-tfmoe.md", "sweeps-and-clusters.md",
                                                "notebook-at-scale.md", "checking-your-own-layers.md"))
    kinds = {c.kind for d in docs for c in d.commands}
    assert {"notebook", "experiment", "mention", "make", "pip", "python"} <= kinds
    assert any(c.error for d in docs for c in d.commands)  # a documented refusal is checked too


def test_the_parser_reads_continuations_quotes_comments_and_console_output(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(textwrap.dedent('''\
        Inline `tfmoe show latest` and `tfmoe conclude`.
        ```bash
        tfmoe route-sim -m seed=0,1 \\
            hydra/launcher=joblib   # a comment with 'quotes'
        tfmoe sql "SELECT run_id FROM runs
                   WHERE status = 'ok'" --format json
        # a comment line
        TFMOE_VALIDATE_ONLY=1 tfmoe arch
        ```
        ```console
        $ tfmoe complexity -m T=256,512
        error: sweep job 0 (T=256): the problem
        ```
        '''), encoding="utf-8")
    doc = parse(page, root=tmp_path)
    argvs = [c.argv for c in doc.commands]
    assert argvs[0] == ("tfmoe", "route-sim", "-m", "seed=0,1", "hydra/launcher=joblib")
    assert argvs[1] == ("tfmoe", "sql", "SELECT run_id FROM runs\n           WHERE status = 'ok'", "--format", "json")
    assert doc.commands[2].env == (("TFMOE_VALIDATE_ONLY", "1"),) and argvs[2] == ("tfmoe", "arch")
    assert doc.commands[3].error == "error: sweep job 0 (T=256): the problem"
    assert [(c.argv, c.kind) for c in doc.commands[4:]] == [(("tfmoe", "show", "latest"), "notebook"),
                                                             (("tfmoe", "conclude"), "mention")]


def test_every_documented_command_works(notebook: Notebook) -> None:
    """Notebook commands for real, experiment commands through the CLI's validation, the rest by their rule."""
    import importlib.util
    import time

    ray = importlib.util.find_spec("hydra_plugins.hydra_ray_launcher") is not None  # test_ray's condition
    problems, seen, took = [], set(), []
    for doc in all_docs():
        named: dict[str, str] = {}
        for cmd in doc.commands:
            key = (cmd.argv, cmd.env, cmd.error, cmd.kind)
            if key in seen and not RUN_ID.search(cmd.text):  # the same command shown twice runs once
                continue
            if cmd.launcher == "ray" and not ray:
                continue  # without the `ray` extra such a command exits 2 naming it (tests/test_ray.py)
            seen.add(key)
            start = time.perf_counter()
            problem = check(cmd, notebook, named)
            took.append((time.perf_counter() - start, cmd.where))
            if problem:
                problems.append(problem)
        for where, source in doc.python:
            problem = run_python_block(where, source, notebook, named)
            if problem:
                problems.append(problem)
    print("slowest:", ", ".join(f"{where} {t:.1f} s" for t, where in sorted(took, reverse=True)[:8]))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("plant, expected", [
    (lambda argv: (*argv, "bogus_key=1"), "unknown config key 'bogus_key'"),
    (lambda argv: (*argv, "--bogus-option=1"), "unrecognized arguments: --bogus-option=1"),
    (lambda argv: (*argv[:2], "--dtype", "fp8", *argv[2:]), "exit 2"),
])
def test_a_documented_experiment_command_with_a_planted_bug_fails(notebook: Notebook, plant, expected) -> None:
    """A copy of a documented block with a bogus key or option: the runner says which command broke and why."""
    doc = parse(REPO / "docs" / "sweeps-and-clusters.md")
    cmd = next(c for c in doc.commands if c.kind == "experiment" and c.launcher == "joblib")
    assert check(cmd, notebook, {}) is None
    broken = Command(cmd.where, cmd.text + " (planted)", plant(cmd.argv), cmd.env)
    problem = check(broken, notebook, {})
    assert problem is not None and expected in problem and cmd.where in problem


def test_a_copy_of_a_doc_block_with_a_planted_unknown_key_fails(notebook: Notebook, tmp_path: Path) -> None:
    """The first bash block of docs/sweeps-and-clusters.md, copied into a page with `bogus_key=1` added to its first
    command: parsed and run like the real docs, exactly that command is reported, naming the key."""
    text = (REPO / "docs" / "sweeps-and-clusters.md").read_text(encoding="utf-8")
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    first = block.splitlines()[0]
    planted = block.replace(first, first.replace(" -m ", " bogus_key=1 -m ", 1), 1)
    assert planted != block
    for body, expected in ((block, 0), (planted, 1)):
        page = tmp_path / "page.md"
        page.write_text(f"# page\n\n```bash\n{body}```\n", encoding="utf-8")
        problems = [p for c in parse(page, root=tmp_path).commands
                    if c.launcher not in ("submitit_slurm", "ray") and (p := check(c, notebook, {}))]
        assert len(problems) == expected, problems
    assert "page.md:4" in problems[0] and "unknown config key 'bogus_key'" in problems[0]


def test_a_documented_notebook_command_with_a_planted_bug_fails(notebook: Notebook) -> None:
    doc = parse(REPO / "docs" / "using-tfmoe.md")
    cmd = next(c for c in doc.commands if c.argv[:2] == ("tfmoe", "runs"))
    assert check(cmd, notebook, {}) is None
    for argv in [(*cmd.argv, "--bogus-option"), ("tfmoe", "show", "no-such-run"), ("tfmoe", "runs", "--last", "0")]:
        assert check(Command(cmd.where, "planted", argv), notebook, {}) is not None


def test_a_documented_refusal_that_no_longer_refuses_fails(notebook: Notebook) -> None:
    """The console block's `error:` line is part of what is checked: a different message, or none, fails."""
    doc = parse(REPO / "docs" / "sweeps-and-clusters.md")
    refusal = next(c for c in doc.commands if c.error)
    assert check(refusal, notebook, {}) is None
    reworded = Command(refusal.where, refusal.text, refusal.argv, refusal.env, refusal.error.replace("D", "E"))
    assert "expected exit 2" in check(reworded, notebook, {})
    accepted = Command(refusal.where, refusal.text, (*refusal.argv, "D=256"), refusal.env, refusal.error)
    assert "got exit 0" in check(accepted, notebook, {})


def test_other_kinds_fail_when_broken(notebook: Notebook) -> None:
    make = Command("x:1", "make no-such-target", ("make", "no-such-target"))
    pip = Command("x:1", "pip install -e '.[nope]'", ("pip", "install", "-e", ".[nope]"))
    script = Command("x:1", "python scripts/check_lock.py --bogus", ("python", "scripts/check_lock.py", "--bogus"))
    missing = Command("x:1", "python scripts/nope.py", ("python", "scripts/nope.py"))
    mention = Command("x:1", "tfmoe nope", ("tfmoe", "nope"), inline=True)
    for cmd in (make, pip, script, missing, mention):
        assert check(cmd, notebook, {}) is not None, cmd
    srun = next(c for d in all_docs() for c in d.commands if c.kind == "srun")
    assert check(srun, notebook, {}) is None
    more_tasks = Command(srun.where, srun.text, tuple("4" if w == "2" else w for w in srun.argv[:3]) + srun.argv[3:])
    assert "ep_size=2 but this SLURM step runs 4 tasks" in (check(more_tasks, notebook, {}) or "")
    not_tfmoe = Command("x:1", "srun -n 2 hostname", ("srun", "-n", "2", "hostname"))
    assert "starts a tfmoe experiment's tasks" in (check(not_tfmoe, notebook, {}) or "")
    assert run_python_block("x:1", "import pandas as pd\npd.read_parquet('runs/nope.parquet')\n", notebook, {})


def _experiment_commands() -> list[Command]:
    return [c for d in all_docs() for c in d.commands if c.kind == "experiment"]


@pytest.fixture(scope="module")
def real_notebook(tmp_path_factory: pytest.TempPathFactory) -> Notebook:
    cwd = tmp_path_factory.mktemp("docs-real")
    write_files(all_docs(), cwd)
    return make_notebook(cwd)


def _skip_unless_runnable_here(cmd: Command) -> None:
    import importlib.util

    import torch

    if cmd.cuda and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if cmd.launcher == "ray" and importlib.util.find_spec("hydra_plugins.hydra_ray_launcher") is None:
        pytest.skip("the `ray` extra is not installed")
    if any(w.startswith("hydra.launcher.ray.init.address=") for w in cmd.argv):
        pytest.skip("needs an existing Ray cluster at that address")


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("cmd", [c for c in _experiment_commands() if c.launcher != "submitit_slurm"],
                         ids=lambda c: f"{c.where}")
def test_every_documented_experiment_command_runs(cmd: Command, real_notebook: Notebook) -> None:
    """Each experiment command for real (a subprocess, as typed), local launchers (Ray where the plugin is
    installed, CUDA ones on CUDA)."""
    _skip_unless_runnable_here(cmd)
    assert check(cmd, real_notebook, {}, real=True) is None


@pytest.mark.cluster
@pytest.mark.timeout(900)
@pytest.mark.parametrize("cmd", [c for c in _experiment_commands() if c.launcher == "submitit_slurm"],
                         ids=lambda c: f"{c.where}")
def test_every_documented_slurm_command_runs(cmd: Command, real_notebook: Notebook) -> None:
    """The SLURM commands on the single-node cluster of scripts/slurm-up.sh (make test-cluster); the GPU one needs
    a cluster with a gpu partition and CUDA."""
    if shutil.which("sbatch") is None:
        pytest.fail("no SLURM here: run `make test-cluster` (it starts the cluster with scripts/slurm-up.sh)")
    _skip_unless_runnable_here(cmd)
    assert check(cmd, real_notebook, {}, real=True) is None


def test_validate_only_checks_a_single_run_and_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TFMOE_VALIDATE_ONLY=1: a good command says it is valid and runs nothing; a bad setting is refused up front
    with nothing written, as a plain single run refuses it before its directory exists (issue 24)."""
    from tfmoe.api.testing import run_cli

    monkeypatch.setenv("TFMOE_VALIDATE_ONLY", "1")
    good = run_cli(["complexity", "-m", "T=128,512", "D=256"], tmp_path)
    assert good.exit_code == 0 and good.stdout.strip() == (
        "valid: tfmoe complexity, 2 job(s); nothing was run (TFMOE_VALIDATE_ONLY is set)")
    bad = run_cli(["complexity", "T=256"], tmp_path)
    assert bad.exit_code == 2 and "T=256 and D=None: give both T and D" in bad.stderr
    assert not list((tmp_path / "runs").rglob("run.parquet")) if (tmp_path / "runs").exists() else True
    monkeypatch.setenv("TFMOE_VALIDATE_ONLY", "0")  # off again: the single run refuses it the same way
    ran = run_cli(["complexity", "T=256"], tmp_path)
    assert ran.exit_code == 2 and ran.run_dir is None and "T=256 and D=None" in ran.stderr
