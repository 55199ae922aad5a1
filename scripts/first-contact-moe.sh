#!/usr/bin/env bash
# First contact, MoE: installs the two libraries not in the lock (torchscale, mh-moe; torchao is) into
# .venv-fc-moe-libs without their requirements (none of the modules judged imports them) and runs
# scripts/first_contact_moe.py with the worktree's venv. Not run by CI.
#   bash scripts/first-contact-moe.sh [--only ID] [--markdown FILE] [--json FILE]
set -euo pipefail
cd "$(dirname "$0")/.."
LIBS=.venv-fc-moe-libs
PKGS=(torchscale==0.3.0 mh-moe==0.0.2)
if [ "$(cat "$LIBS/.installed" 2>/dev/null)" != "${PKGS[*]}" ]; then
    rm -rf "$LIBS"
    .venv/bin/python -m pip install -q --no-deps --target "$LIBS" "${PKGS[@]}"
    echo "${PKGS[*]}" > "$LIBS/.installed"
fi
PYTHONPATH="$PWD/$LIBS${PYTHONPATH:+:$PYTHONPATH}" .venv/bin/python scripts/first_contact_moe.py "$@"
