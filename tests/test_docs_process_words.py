"""The product speaks of the product: no tracker numbers and no words about how the work was organised in README,
docs/, experiments/, src/ or failures.md; failures.md's index table is in step with its entries."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("failures_index", REPO / "scripts" / "failures_index.py")
failures_index = importlib.util.module_from_spec(spec)
spec.loader.exec_module(failures_index)

# Each pattern names what it catches; matched case-insensitively on whole words.
PROCESS_WORDS = {
    "a tracker number": r"\bissues? ?#?\d+\b",
    "a work-item number": r"\b(?:work )?items? ?-?\d+\b",
    "a work item": r"\bwork items?\b",
    "a sitting": r"\bsittings?\b",
    # a Unix process session (setsid: "a new session", "a session of its own") is a product word
    "a session": r"\b(?<!new )(?<!process )sessions?\b(?! of (?:its|their) own)(?! leader)",
    "an assistant": r"\bassistants?\b",
    "a helper": r"\bhelpers?\b",
    "a stop of the work": r"\b(?:this|that|the previous|an earlier|the last|the next) stop\b",
    "a branch of the work": r"(?-i:(?<![\w/.])h/[a-z][a-z-]{2,}\b)",
    "the lead engineer": r"\blead engineer\b",
}
PATTERN = re.compile("|".join(f"(?P<w{i}>{p})" for i, p in enumerate(PROCESS_WORDS.values())), re.I)
NAMES = list(PROCESS_WORDS)


def product_files() -> list[Path]:
    files = [REPO / "README.md", REPO / "failures.md"]
    files += sorted(p for p in (REPO / "docs").rglob("*") if p.suffix in (".md", ".py", ".txt"))
    files += sorted(p for p in (REPO / "experiments").rglob("*") if p.suffix in (".md", ".csv", ".txt"))
    files += sorted((REPO / "src").rglob("*.py"))
    return [p for p in files if p.is_file()]


def process_words(text: str) -> list[tuple[int, str, str]]:
    """(line, what, the words) for every process word in ``text``."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        for m in PATTERN.finditer(line):
            what = NAMES[int(next(k for k, v in m.groupdict().items() if v is not None)[1:])]
            out.append((n, what, m.group(0)))
    return out


def test_the_product_has_no_process_words() -> None:
    found = [f"{p.relative_to(REPO)}:{n}: {what} ({words!r})"
             for p in product_files() for n, what, words in process_words(p.read_text(encoding="utf-8"))]
    assert not found, "words about how the work was organised, not about the product:\n" + "\n".join(found)


@pytest.mark.parametrize("line", [
    "measured in issue 28's kernel section", "Issue 11 item 9", "see item-9's table", "which sitting measured it",
    "this session's AMD EPYC", "the assistant ran it", "merging the helpers' branches", "before this stop, views",
    "(h/holes at f759138)", "a work item", "as the lead engineer said",
])
def test_the_scan_catches_process_words(line: str) -> None:
    assert process_words(line), line


@pytest.mark.parametrize("line", [
    "the run stops at the first NaN", "a stop token ends the row", "pytest's sessionstart hook", "items of a batch",
    "the output's item() is a float", "tokens/h", "sqrt(d_h/2)", "a tissue of lies", "leading dimension", "H/Hkv heads", "the lead of fp32",
])
def test_the_scan_leaves_product_words_alone(line: str) -> None:
    assert not process_words(line), line


def test_failures_index_is_current() -> None:
    assert failures_index.main(["--check"]) == 0, "run: python scripts/failures_index.py"


def test_failures_index_has_every_entry_once_in_order() -> None:
    text = (REPO / "failures.md").read_text(encoding="utf-8")
    ids = [f"F-{m[1]}" for m in failures_index.HEADING.finditer(text)]
    listed = re.findall(r"^\| \[(F-\d+)\]", text, re.M)
    assert ids and listed == ids
    assert len(set(ids)) == len(ids), "an F-number is used twice"


def test_failures_index_follows_an_appended_entry(tmp_path: Path) -> None:
    """An entry appended after the index (as `tfmoe failures add` and merged branches do) makes the index stale;
    the script brings it back in step, picks up an (open) status and a guarding test, and is idempotent."""
    log = tmp_path / "failures.md"
    text = (REPO / "failures.md").read_text(encoding="utf-8")
    log.write_text(text + "\n## F-9999 (open): a | pipe in the title\n\n- **Phenomenon**: x\n- **Fix**: not yet\n"
                   "- **Regression test**: `tests/test_x.py::test_y[case]` and more\n", encoding="utf-8")
    assert failures_index.main(["--check", "--file", str(log)]) == 1
    assert failures_index.main(["--file", str(log)]) == 0
    assert failures_index.main(["--check", "--file", str(log)]) == 0
    new = log.read_text(encoding="utf-8")
    assert "| a \\| pipe in the title | `tests/test_x.py::test_y` | open |" in new
    assert new.count(failures_index.BEGIN) == 1
    assert new.endswith("- **Regression test**: `tests/test_x.py::test_y[case]` and more\n")


def test_failures_list_reads_an_open_entry(tmp_path: Path) -> None:
    from tfmoe.harness.method.failures import ENTRY_RE

    text = "# Failures log\n\n## F-1: a\n\n## F-2 (open): b\n"
    assert ENTRY_RE.findall(text) == [("1", "a"), ("2", "b")]
