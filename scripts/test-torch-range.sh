#!/usr/bin/env bash
# tfmoe beside the oldest and the newest torch that pyproject.toml admits, as an engineer's own project would hold
# them: PyPI's torch (a CUDA build; it runs on CPU), and tfmoe from the wheel built from this checkout
# (scripts/build-dist.sh), never editable. Two venvs:
#   .venv-torch-floor  the floor torch (the `torch>=` of pyproject.toml), then the wheel with its dev and
#                      xtransformers extras as pip resolves them beside it (at the lock's versions) and the Hydra
#                      packages' floors (~4.8 GB, nearly all torch);
#   .venv-timm         the newest torch, 2.14.1, with the whole lock but torch: shared with scripts/test-timm.sh
#                      (built by it when missing).
# Usage: bash scripts/test-torch-range.sh [floor|newest|both]   (default both; to try another floor, change
# pyproject.toml's `torch>=`: the venv is rebuilt)
# In each, from an empty directory outside the checkout: the API, plugin, packaging and kernel battery tests
# (pytest -n 2; the packaging test's pip --dry-run must plan no torch change there), the docs' example under
# pytest-xdist with a planted bug, then `tfmoe <experiment>` for every experiment (each must end ok).
# An existing .venv-torch-floor with these versions and this lock is reused. CI runs this (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PYTHON=${PYTHON:-python3}
FLOOR_VENV=$REPO/${TORCH_FLOOR_VENV:-.venv-torch-floor}
NEWEST_VENV=$REPO/${TIMM_VENV:-.venv-timm}
FLOOR=$(sed -n 's/^ *"torch>=\([0-9.]*\),<[0-9.]*",.*/\1/p' pyproject.toml)
which=${1:-both}  # floor | newest | both
[[ $which =~ ^(floor|newest|both)$ ]] || { echo "usage: test-torch-range.sh [floor|newest|both]" >&2; exit 2; }
mapfile -t HYDRA_FLOORS < <(sed -n 's/^ *"\(hydra-[a-z-]*\)>=\([0-9.]*\),<[0-9.]*",.*/\1==\2/p' pyproject.toml)
[ -n "$FLOOR" ] && [ "${#HYDRA_FLOORS[@]}" = 3 ] || { echo "test-torch-range: no torch/hydra floors in pyproject.toml" >&2; exit 1; }
TESTS=(test_checks.py test_checks_applicable.py test_checks_one_verdict.py test_pytest_plugin.py
       test_pytest_plugin_xdist.py test_packaging.py test_attn_kernels.py test_attn_kernel_faults.py)
# one CLI run of every experiment with its defaults, but complexity's timing of three (T, D) groups (~1-3 min): one
declare -A SMALL=([complexity]="T=256 D=128 min_run_time=0.05")
start=$(date +%s)

wheel=$(bash scripts/build-dist.sh | tail -1)
stamp="torch==$FLOOR ${HYDRA_FLOORS[*]} $(sha256sum requirements.lock pyproject.toml | sha256sum | cut -c1-16)"
if [[ $which != newest ]] && [ "$(cat "$FLOOR_VENV/.installed" 2>/dev/null)" != "$stamp" ]; then
    rm -rf "$FLOOR_VENV"
    "$PYTHON" -m venv "$FLOOR_VENV"
    # the engineer's project: its torch first, then tfmoe as they would add it (pip resolves what is missing), at
    # the lock's versions where the lock has them, but the Hydra floors, and torch's own requirements as torch
    # states them (torch 2.11 needs setuptools<82, the lock has 84)
    "$FLOOR_VENV/bin/pip" install -q "torch==$FLOOR"
    PYTHONPATH=src "$PYTHON" -c "from pathlib import Path; import sys; from tfmoe.harness.store.lockfile import read_lock
skip = {'torch', 'setuptools', 'pip', *(h.split('==')[0] for h in sys.argv[1:])}
print(*(f'{n}=={v}' for n, v in read_lock(Path('requirements.lock')).items() if n not in skip), sep='\n')" \
        "${HYDRA_FLOORS[@]}" > "$FLOOR_VENV/pins.txt"
    "$FLOOR_VENV/bin/pip" install -q -c "$FLOOR_VENV/pins.txt" "$wheel[dev,xtransformers]" "${HYDRA_FLOORS[@]}"
    echo "$stamp" > "$FLOOR_VENV/.installed"
fi
if [[ $which != floor ]] && [ ! -x "$NEWEST_VENV/bin/python" ]; then
    TIMM_VENV=$(basename "$NEWEST_VENV") bash scripts/test-timm.sh
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
venvs=()
[[ $which == newest ]] || venvs+=("$FLOOR_VENV")
[[ $which == floor ]] || venvs+=("$NEWEST_VENV")

for venv in "${venvs[@]}"; do
    t0=$(date +%s)
    "$venv/bin/pip" install -q --no-deps --force-reinstall "$wheel"
    "$venv/bin/pip" check  # the torch, Hydra and everything else in tfmoe's declared ranges
    dir=$(mktemp -d -p "$work")
    cd "$dir"
    "$venv/bin/python" - <<'PY'
import importlib.metadata as md, tfmoe, torch
assert "/site-packages/tfmoe/" in tfmoe.__file__, tfmoe.__file__  # the wheel, not the checkout
print(f"== torch {torch.__version__}, hydra-core {md.version('hydra-core')}, tfmoe from {tfmoe.__file__}")
PY
    "$venv/bin/python" -m pytest -q -p no:cacheprovider -n 2 "${TESTS[@]/#/$REPO/tests/}"
    if [ "$venv" = "$NEWEST_VENV" ]; then  # the docs' example under xdist, a bug planted (~1.5 min): newest only
        "$venv/bin/python" -m pytest -q -p no:cacheprovider -m slow \
            "$REPO/tests/test_pytest_plugin_xdist.py::test_the_example_under_xdist_from_another_directory"
    fi
    for exp in $("$venv/bin/python" -c "from tfmoe.contract.registry import EXPERIMENTS; print(*EXPERIMENTS)"); do
        # shellcheck disable=SC2086  # SMALL's words are separate overrides
        "$venv/bin/tfmoe" "$exp" ${SMALL[$exp]:-} > "$exp.log" 2>&1 \
            || { cat "$exp.log"; echo "test-torch-range: tfmoe $exp failed beside $(basename "$venv")" >&2; exit 1; }
    done
    "$venv/bin/tfmoe" runs --format json > runs.json
    "$venv/bin/python" - <<'PY'
import json
from tfmoe.contract.registry import EXPERIMENTS
runs = json.load(open("runs.json"))
ended = {r["experiment"]: r["status"] for r in runs}
assert ended == {e: "ok" for e in EXPERIMENTS}, ended
print(f"CLI: {len(ended)} experiments, every one ok")
PY
    cd "$REPO"
    echo "test-torch-range: $(basename "$venv") in $(( $(date +%s) - t0 )) s"
done
echo "test-torch-range: torch $FLOOR and the newest, $(( $(date +%s) - start )) s"
