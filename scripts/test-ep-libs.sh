#!/usr/bin/env bash
# route-sim's shipped expert-parallel adapter (ep_impl=lib:fairscale) in a venv of its own (.venv-ep): fairscale
# 0.4.13 is an sdist, kept out of the lock, built with --no-build-isolation beside the main venv's CPU torch 2.13.0;
# the rest of the project from the lock without torch. Its tests must run there, not skip. An existing .venv-ep with
# these pins and this lock is reused. Needs about 1.5 GB of disk (torch's CPU build and the locked packages).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${EP_VENV:-.venv-ep}
PYTHON=${PYTHON:-python3}
PINS=(torch==2.13.0 fairscale==0.4.13)
start=$(date +%s)
stamp="${PINS[*]} $(sha256sum requirements.lock pyproject.toml | sha256sum | cut -c1-16)"
if [ "$(cat "$VENV/.installed" 2>/dev/null)" != "$stamp" ]; then
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install -q torch==2.13.0 setuptools wheel
    PYTHONPATH=src "$VENV/bin/python" scripts/check_lock.py --without torch > "$VENV/lock-without-torch.txt"
    "$VENV/bin/pip" install -q --require-hashes --no-deps -r "$VENV/lock-without-torch.txt"
    "$VENV/bin/pip" install -q --no-deps --no-build-isolation fairscale==0.4.13
    "$VENV/bin/pip" install -q --no-deps --no-build-isolation -e .
    "$VENV/bin/pip" check
    echo "$stamp" > "$VENV/.installed"
fi
"$VENV/bin/python" -c "import fairscale, torch; print('fairscale', fairscale.__version__, 'torch', torch.__version__)"
out=$(CI=true "$VENV/bin/pytest" -q -rs -p no:cacheprovider tests/test_route_ep.py -k "fairscale") \
    || { echo "$out"; exit 1; }
echo "$out"
if grep -q '^SKIPPED' <<<"$out"; then
    echo "test-ep-libs: fairscale tests skipped" >&2
    exit 1
fi
grep -qE '[0-9]+ passed' <<<"$out"
echo "test-ep-libs: $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)"
