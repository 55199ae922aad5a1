#!/usr/bin/env bash
# route-sim's shipped expert-parallel adapters (ep_impl=lib:fairscale, ep_impl=lib:deepspeed) in a venv of their own
# (.venv-ep): fairscale 0.4.13 and deepspeed 0.19.8 are sdists, kept out of the lock, built with --no-build-isolation
# beside the main venv's CPU torch 2.13.0 (deepspeed with DS_BUILD_OPS=0: no compiled op, and --no-deps: of its
# requirements the lock has all it imports but hjson, installed here; ninja and py-cpuinfo serve only its JIT op
# builds and are left out, the two lines of `pip check` allowed below); the rest of the project from the lock
# without torch. Their tests must run there, not skip. An existing .venv-ep with these pins and this lock is reused.
# Needs about 2.5 GB of disk (torch's CPU build, the locked packages, the two libraries).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${EP_VENV:-.venv-ep}
PYTHON=${PYTHON:-python3}
PINS=(torch==2.13.0 fairscale==0.4.13 deepspeed==0.19.8 hjson==3.1.0)
# deepspeed's requirements it never imports here (its op builders' only): pip check may name these, nothing else
ALLOWED_MISSING='^deepspeed 0\.19\.8 requires (ninja|py-cpuinfo), which is not installed\.$'
start=$(date +%s)
stamp="${PINS[*]} $(sha256sum requirements.lock pyproject.toml | sha256sum | cut -c1-16)"
if [ "$(cat "$VENV/.installed" 2>/dev/null)" != "$stamp" ]; then
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install -q torch==2.13.0 setuptools wheel
    PYTHONPATH=src "$VENV/bin/python" scripts/check_lock.py --without torch > "$VENV/lock-without-torch.txt"
    "$VENV/bin/pip" install -q --require-hashes --no-deps -r "$VENV/lock-without-torch.txt"
    "$VENV/bin/pip" install -q --no-deps --no-build-isolation fairscale==0.4.13
    DS_BUILD_OPS=0 DS_ACCELERATOR=cpu "$VENV/bin/pip" install -q --no-deps --no-build-isolation deepspeed==0.19.8 \
        hjson==3.1.0
    "$VENV/bin/pip" install -q --no-deps --no-build-isolation -e .
    broken=$("$VENV/bin/pip" check 2>/dev/null | grep -vE "$ALLOWED_MISSING" | grep -v '^No broken requirements' || true)
    [ -z "$broken" ] || { echo "$broken" >&2; exit 1; }
    echo "$stamp" > "$VENV/.installed"
fi
DS_ACCELERATOR=cpu "$VENV/bin/python" -c "import fairscale, deepspeed, torch; print('fairscale', fairscale.__version__, \
'deepspeed', deepspeed.__version__, 'torch', torch.__version__)"
out=$(CI=true "$VENV/bin/pytest" -q -rs -p no:cacheprovider tests/test_route_ep.py -k "fairscale or deepspeed") \
    || { echo "$out"; exit 1; }
echo "$out"
if grep -q '^SKIPPED' <<<"$out"; then
    echo "test-ep-libs: library tests skipped" >&2
    exit 1
fi
grep -qE '[0-9]+ passed' <<<"$out"
echo "test-ep-libs: $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)"
