#!/usr/bin/env bash
# The hf adapters on the declared floor of transformers (tfmoe.adapters.transformers_support.FLOOR), in a second
# venv (.venv-floor): their tests there, then one release below the floor must exit 2 naming the range.
# `make test` covers the newest release (the main venv). CI runs this after `make test` (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${FLOOR_VENV:-.venv-floor}
PYTHON=${PYTHON:-python3}
FLOOR=$(sed -n 's/^FLOOR, CEILING = "\([^"]*\)".*/\1/p' src/tfmoe/adapters/transformers_support.py)
BELOW=${BELOW_FLOOR:-5.12.1}
start=$(date +%s)
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q torch==2.13.0 -e '.[dev]' "transformers==$FLOOR"
echo "hf adapters on transformers $FLOOR (the floor)"
"$VENV/bin/pytest" -q -p no:cacheprovider tests/test_attn_adapters.py tests/test_hf_zoo.py \
    tests/test_route_layer.py -k "hf or HF or transformers or zoo or rope or vetted or version"
echo "transformers $BELOW (below the floor) must exit 2"
"$VENV/bin/pip" install -q torch==2.13.0 "transformers==$BELOW"
out=$("$VENV/bin/pytest" -q -p no:cacheprovider "tests/test_hf_zoo.py::test_out_of_range_install_exits_2" -rs)
echo "$out"
grep -q "1 passed" <<<"$out"  # it skips when the installed release is in range: that must not pass for a test
"$VENV/bin/pip" install -q torch==2.13.0 "transformers==$FLOOR"
echo "test-hf-floor: $(( $(date +%s) - start )) s"
