#!/usr/bin/env bash
# The timm adapters (impl=timm:attention[-unfused]) in a second venv (.venv-timm): `import timm.layers` imports
# torchvision, and PyPI has no torchvision for the main venv's CPU torch 2.13.0, so here torch, torchvision and timm
# are one matching pair pip resolves together (torch 2.14.1 + torchvision 0.29.1, a CUDA build that runs on CPU,
# ~5.5 GB), the rest of the project from the lock without torch (as `make setup` does on a GPU), and tfmoe from the
# wheel built from this checkout (scripts/build-dist.sh; not editable, so a packaging slip shows here too). Their tests
# must run there, not skip. An existing .venv-timm with these versions and this lock is reused; the wheel is
# reinstalled every time. It is also the newest-torch venv of scripts/test-torch-range.sh. CI runs both (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TIMM_VENV:-.venv-timm}
PYTHON=${PYTHON:-python3}
PINS=(torch==2.14.1 torchvision==0.29.1 timm==1.0.31)
start=$(date +%s)
stamp="${PINS[*]} $(sha256sum requirements.lock pyproject.toml | sha256sum | cut -c1-16)"
if [ "$(cat "$VENV/.installed" 2>/dev/null)" != "$stamp" ]; then
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install -q "${PINS[@]}"
    PYTHONPATH=src "$VENV/bin/python" scripts/check_lock.py --without torch > "$VENV/lock-without-torch.txt"
    "$VENV/bin/pip" install -q --require-hashes --no-deps -r "$VENV/lock-without-torch.txt"
    echo "$stamp" > "$VENV/.installed"
fi
wheel=$(bash scripts/build-dist.sh | tail -1)
"$VENV/bin/pip" install -q --no-deps --force-reinstall "$wheel"
"$VENV/bin/pip" check  # tfmoe's torch range admits this torch: no conflict at all
"$VENV/bin/python" -c "import timm.layers, torch, torchvision; print('timm', timm.__version__, 'torch', \
torch.__version__, 'torchvision', torchvision.__version__)"
out=$(CI=true "$VENV/bin/pytest" -q -rs -p no:cacheprovider tests/test_attn_libraries.py -k timm) \
    || { echo "$out"; exit 1; }
echo "$out"
# the one skip allowed: the exit-2 test for a timm that does not import; any other skip is a timm test not run
if grep '^SKIPPED' <<<"$out" | grep -v 'timm imports here'; then
    echo "test-timm: timm tests skipped" >&2
    exit 1
fi
grep -qE '[0-9]+ passed' <<<"$out"
echo "test-timm: $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)"
