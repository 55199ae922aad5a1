#!/usr/bin/env bash
# The sdist and the wheel of this checkout, as a user's `pip install` gets them: `python -m build` makes the sdist,
# then the wheel from the unpacked sdist (so a file the sdist lacks is missing from the wheel too). Into dist/ (or
# $1), with .venv's build and setuptools (no download). Prints the wheel's path, last. tests/test_packaging.py checks
# what the wheel holds.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-dist}
BUILD_PYTHON=${BUILD_PYTHON:-.venv/bin/python}
rm -rf "$OUT"
"$BUILD_PYTHON" -m build --no-isolation --outdir "$OUT" . > "$OUT.log" 2>&1 || { cat "$OUT.log" >&2; exit 1; }
rm -f "$OUT.log"
ls "$OUT"/*.tar.gz > /dev/null
realpath "$OUT"/tfmoe-*.whl
