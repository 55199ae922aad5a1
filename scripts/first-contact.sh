#!/usr/bin/env bash
# First contact (issue 28, item 6): five public libraries tfmoe has never used, plugged in through the docs only
# (adapters in scripts/first_contact/), one correct case or more and two bugs planted inside each library's own
# code, every case through the CLI. Builds its own venv (.venv-first-contact: CPU torch 2.13.0, the lock, tfmoe,
# then the libraries with torch pinned), runs scripts/first_contact.py and writes the table. Not run by CI.
#   bash scripts/first-contact.sh [--only ID] [--markdown FILE] [--json FILE]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${FC_VENV:-.venv-first-contact}
PYTHON=${PYTHON:-python3}
# the releases measured on 2026-12-03; keras's torch backend needs nothing beyond its own requirements
WITH_DEPS=(keras==3.15.1 labml==0.5.3 einops docstring-parser)
NO_DEPS=(labml-nn==0.5.1 torchscale==0.3.0 memory-efficient-attention-pytorch==0.1.6 mistral-inference==1.6.0
         simple-parsing==0.1.9)
stamp="${WITH_DEPS[*]} ${NO_DEPS[*]} $(sha256sum requirements.lock pyproject.toml | sha256sum | cut -c1-16)"
if [ "$(cat "$VENV/.installed" 2>/dev/null)" != "$stamp" ]; then
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install -q torch==2.13.0
    "$VENV/bin/pip" install -q --require-hashes --no-deps -r requirements.lock
    "$VENV/bin/pip" install -q --no-deps --no-build-isolation -e .
    pins=$(mktemp); echo torch==2.13.0 > "$pins"
    # keras and labml with their own requirements (torch pinned); the others without theirs: labml-nn asks for
    # torchtext, torchvision and fairscale, torchscale for fairscale 0.4.0 and timm 0.6.13, mistral-inference for
    # xformers, none of which the layers judged here import (mistral_inference.moe, labml_nn.transformers.{mha,
    # switch}, torchscale.component); einops is labml-nn's and mea's, docstring-parser simple-parsing's
    "$VENV/bin/pip" install -q -c "$pins" "${WITH_DEPS[@]}"
    "$VENV/bin/pip" install -q -c "$pins" --no-deps "${NO_DEPS[@]}"
    "$VENV/bin/python" -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
    echo "$stamp" > "$VENV/.installed"
fi
"$VENV/bin/python" scripts/first_contact.py "$@"
