"""Does this environment hold exactly the locked versions? `make setup` runs it after installing from the lock.

    python scripts/check_lock.py                  # compare `pip freeze --all` of this Python with requirements.lock
    python scripts/check_lock.py --skip torch     # a CUDA build of torch installed on purpose (docs/gpu.md)
    python scripts/check_lock.py --without torch  # print the lock without torch's entry (make setup on a GPU)

Exit 0 when every locked package is installed at its locked version, 1 (one line per package) otherwise.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

from tfmoe.harness.store.lockfile import LOCK_FILE, canonical, parse_lock

ROOT = Path(__file__).resolve().parents[1]


def frozen(python: str = sys.executable) -> dict[str, str]:
    """{canonical name: version} from `pip freeze --all` of ``python`` (editable and URL installs skipped)."""
    out = subprocess.run([python, "-m", "pip", "freeze", "--all"], capture_output=True, text=True, check=True).stdout
    return parse_lock(out)


def mismatches(locked: dict[str, str], installed: dict[str, str], skip: set[str]) -> list[str]:
    """One line per locked package that is missing or at another version."""
    lines = []
    for name, version in sorted(locked.items()):
        if name in skip:
            continue
        have = installed.get(name)
        if have != version:
            lines.append(f"{name}: locked {version}, installed {have or 'nothing'}")
    return lines


def without(text: str, names: set[str]) -> str:
    """The lock's text with the entries (pin line, its hashes and comments) of ``names`` left out."""
    kept, dropping = [], False
    for line in text.splitlines():
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==", line)
        if m:
            dropping = canonical(m.group(1)) in names
        elif not line.startswith((" ", "\t")):
            dropping = False
        if not dropping:
            kept.append(line)
    return "\n".join(kept) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lock", type=Path, default=ROOT / LOCK_FILE)
    parser.add_argument("--skip", action="append", default=[], help="a locked package not to compare")
    parser.add_argument("--without", action="append", default=[], help="print the lock without this package")
    args = parser.parse_args(argv)
    text = args.lock.read_text(encoding="utf-8")
    if args.without:
        sys.stdout.write(without(text, {canonical(n) for n in args.without}))
        return 0
    locked = parse_lock(text)
    bad = mismatches(locked, frozen(), {canonical(n) for n in args.skip})
    for line in bad:
        print(line, file=sys.stderr)
    print(f"{args.lock.name}: {len(locked) - len(bad)} of {len(locked)} locked packages installed at their versions"
          + ("" if not bad else f"; {len(bad)} differ: run `make setup`"))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
