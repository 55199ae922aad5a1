#!/usr/bin/env bash
# Fail fast, in one line, when DIR's file system has less than GIB GiB free: a fresh clone's CI builds three venvs
# (.venv, .venv-floor, .venv-timm) and fills a disk that holds less, mid-`pip install` (F-158).
# Usage: scripts/check-free-space.sh GIB [DIR]   (DIR defaults to the current directory)
set -euo pipefail
need=${1:-}
dir=${2:-.}
if ! [[ "$need" =~ ^[0-9]+$ ]] || [ "$need" -lt 1 ]; then
    echo "error: check-free-space.sh needs the GiB to require as a whole number ≥ 1 (got '${need}'): usage: check-free-space.sh GIB [DIR]" >&2
    exit 2
fi
if ! free_k=$(df -Pk -- "$dir" 2>/dev/null | awk 'NR == 2 {print $4}') || [ -z "$free_k" ]; then
    echo "error: check-free-space.sh cannot read the free space of '$dir': pass a directory that exists" >&2
    exit 2
fi
free_g=$(( free_k / 1024 / 1024 ))
if [ "$free_k" -lt $(( need * 1024 * 1024 )) ]; then
    echo "error: $(cd "$dir" && pwd) has ${free_g} GiB free and this needs about ${need} GiB (three venvs and pip's unpacking): free some space (old clones, their .venv* directories) and run again" >&2
    exit 2
fi
echo "free space: ${free_g} GiB on $(cd "$dir" && pwd) (needs ${need})"
