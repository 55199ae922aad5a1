"""tokenize's input: the samples of a UTF-8 file (a category per line where every line has one, else plain text),
or of the shipped parallel corpus."""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from tfmoe.contract.errors import BadInput

CORPUS_FILE = "corpus_parallel.tsv"
CATEGORY_RE = re.compile(r"^([A-Za-z][A-Za-z0-9_-]{0,31})\t(.*)$", re.DOTALL)
DEFAULT_CATEGORY = "text"


@dataclass(frozen=True)
class Sample:
    line: int  # 0-based line number in the input
    category: str
    text: str


def shipped_corpus() -> Path:
    return Path(str(resources.files("tfmoe") / "data" / CORPUS_FILE))


def read_samples(path: str | Path | None) -> tuple[list[Sample], str, int]:
    """Samples of a UTF-8 file (None = the shipped corpus), its description and the number of skipped
    empty lines. Lines are split on '\\n' only (a trailing '\\r' is dropped); a leading BOM is ignored."""
    file = shipped_corpus() if path is None else Path(str(path)).expanduser()
    if not file.exists():
        raise BadInput(f"input file {file} does not exist: pass input=PATH to a UTF-8 text file (or input=null)")
    if file.is_dir():
        raise BadInput(f"input {file} is a directory: pass input=PATH to a UTF-8 text file")
    try:
        raw = file.read_bytes()
    except OSError as exc:
        raise BadInput(f"input file {file} cannot be read ({exc.strerror}): fix its permissions or pass "
                       "another file") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n")
        raise BadInput(f"input file {file} is not UTF-8 (byte {exc.start}, line {line}: {exc.reason}): "
                       "convert it, e.g. iconv -t UTF-8") from None
    lines = [ln[:-1] if ln.endswith("\r") else ln for ln in text.split("\n")]
    if lines and lines[-1] == "" and text.endswith("\n"):
        lines.pop()
    filled = [(i, ln) for i, ln in enumerate(lines) if ln.strip()]
    tsv = bool(filled) and all(CATEGORY_RE.match(ln) for _, ln in filled)
    samples: list[Sample] = []
    for i, ln in filled:
        if tsv:
            category, body = CATEGORY_RE.match(ln).groups()
            if not body.strip():
                continue
            samples.append(Sample(i, category, body))
        else:
            samples.append(Sample(i, DEFAULT_CATEGORY, ln))
    if not samples:
        raise BadInput(f"input file {file} has no text (only empty lines): give at least one non-empty line")
    desc = "shipped corpus " + CORPUS_FILE if path is None else str(file)
    return samples, desc, sum(1 for ln in lines if not ln.strip()) + (len(filled) - len(samples))
