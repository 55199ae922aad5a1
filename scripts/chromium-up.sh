#!/usr/bin/env bash
# Install Debian's headless-capable chromium for the MLflow UI browser test (tests/test_export_mlflow.py, slow).
# Needs root. Idempotent: does nothing when chromium is already on PATH. Prints the browser's path.
set -euo pipefail
if ! command -v chromium >/dev/null; then
  [ "$(id -u)" = 0 ] || { echo "chromium-up: needs root to install Debian's chromium (apt-get)" >&2; exit 2; }
  echo "chromium-up: installing chromium from Debian" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends chromium >/dev/null
fi
command -v chromium
