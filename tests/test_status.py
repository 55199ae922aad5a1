"""tfmoe.contract.status: one status type with each status's exit code and the worst-of order of exit codes."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tfmoe.api.testing import run_cli
from tfmoe.contract.status import WORST_FIRST, Status, exit_code_for, signal_exit_code, worst_exit_code

README = Path(__file__).resolve().parents[1] / "README.md"


def test_each_status_is_its_stored_string_and_has_its_exit_code() -> None:
    codes = {s.value: s.exit_code for s in Status}
    assert codes == {"ok": 0, "failed": 1, "error": 2, "crashed": 3, "unexpected": 4, "interrupted": 130,
                     "lost": 137, "running": 3, "not_started": 130, "unreadable": 3}
    assert Status.CRASHED == "crashed" and f"{Status.CRASHED}" == "crashed" and str(Status.LOST) == "lost"
    assert Status("not_started") is Status.NOT_STARTED and {"ok"} == {Status.OK}
    assert [s.value for s in Status if not s.final] == ["lost", "running", "unreadable"]


def test_a_run_writes_the_same_status_strings_to_parquet(tmp_path: Path) -> None:
    from tfmoe.harness.store.notebook import RunWriter
    from tfmoe.harness.store.rundir import RUN_FILE

    writer = RunWriter(run_dir=tmp_path / "r", run_id="r", experiment="x", seed=0, argv=[], overrides=[],
                       device="cpu", dtype="fp32")
    writer.start()
    assert pq.read_table(tmp_path / "r" / RUN_FILE).column("status").to_pylist() == ["running"]
    writer.finish(None, Status.UNEXPECTED, Status.UNEXPECTED.exit_code, None, None, None, 10)
    row = pq.read_table(tmp_path / "r" / RUN_FILE).to_pylist()[0]
    assert (type(row["status"]), row["status"], row["exit_code"]) == (str, "unexpected", 4)
    with pytest.raises(ValueError):  # a writer cannot record a status the readers would not know
        writer.finish(None, "finished", 0, None, None, None, 10)  # type: ignore[arg-type]


def test_worst_of_mixed_lists() -> None:
    assert worst_exit_code([0, 4, 1, 3, 2]) == 2  # bad input > crashed > failed check > expectation missed > ok
    assert worst_exit_code([4, 0]) == 4 and worst_exit_code([1, 4]) == 1 and worst_exit_code([1, 3]) == 3
    assert worst_exit_code([2, 137, 0]) == 137  # a lost job outranks bad input
    assert worst_exit_code([137, 140]) == 140  # any other signal (SIGUSR2: 140) outranks lost...
    assert worst_exit_code([140, 143]) == 143  # ...but not SIGTERM
    assert worst_exit_code([143, 130, 0]) == 130  # and Ctrl-C is worst of all
    assert worst_exit_code(iter([0, 0])) == 0  # any iterable
    assert WORST_FIRST == (130, 143, 137, 2, 3, 1, 4, 0)


def test_worst_of_boundaries() -> None:
    assert worst_exit_code([]) == 0  # nothing ran: ok
    assert worst_exit_code([3]) == 3
    assert worst_exit_code([0, 5]) == 5  # a code tfmoe never gives ranks first: never hidden by a known one
    assert worst_exit_code([130, 128]) == 128  # 128 is no signal (128 + 0): unknown, first
    assert worst_exit_code([137, 129]) == 129  # 129 (SIGHUP) is a signal: after SIGTERM, before lost
    assert signal_exit_code(signal.SIGTERM) == 143 and signal_exit_code(signal.SIGUSR2) == 140


def test_unknown_status_strings() -> None:
    assert Status.parse("crashed") is Status.CRASHED
    for bad in ("bogus", "OK", "", "ok "):
        with pytest.raises(ValueError, match=r"unknown run status .*: pass one of ok, failed, error"):
            Status.parse(bad)
    assert exit_code_for("ok") == 0 and exit_code_for("lost") == 137
    assert exit_code_for("written-by-a-newer-tfmoe") == Status.CRASHED.exit_code  # a reader counts it as crashed


def test_runs_refuses_an_unknown_status_with_one_line(tmp_path: Path) -> None:
    result = run_cli(["runs", "--status", "finished"], tmp_path)
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        "error: --status unknown run status 'finished': pass one of ok, failed, error, crashed, unexpected, "
        "interrupted, lost, running, not_started, unreadable"]


def test_the_readme_exit_code_table_matches_the_status_type() -> None:
    rows = re.findall(r"^\| (\d+) \| (.*) \|$", README.read_text(encoding="utf-8").split("## Exit codes", 1)[1]
                      .split("\n## ", 1)[0], flags=re.M)
    documented = {int(code): text for code, text in rows}
    for status in (Status.FAILED, Status.ERROR, Status.CRASHED, Status.UNEXPECTED, Status.INTERRUPTED, Status.LOST):
        assert f"`{status}`" in documented[status.exit_code], (status, documented.get(status.exit_code))
    order = re.search(r"worst of its jobs' codes \(([^)]*)\)", README.read_text(encoding="utf-8")).group(1)
    assert order == "130 > 143 > other signals > 137 > 2 > 3 > 1 > 4 > 0"
    assert [int(c) for c in order.replace("other signals", "").split(" > ") if c.strip()] == list(WORST_FIRST)
