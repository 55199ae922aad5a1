# Two commands (README): `make run` sets up and runs every experiment; `make test` sets up and runs the tests.
VENV ?= .venv
PYTHON ?= python3
# Where pip finds torch. Empty = the default index (on the project's CPU machines a local CPU wheel).
# GPU users: make setup TORCH_INDEX_URL=<PyTorch CUDA wheel index>, see README "GPU install".
TORCH_INDEX_URL ?=
TORCH_SPEC = torch==2.13.0

.PHONY: setup run test test-slow lint bench clean
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q "$(TORCH_SPEC)" $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	$(VENV)/bin/pip install -q -e '.[dev,hf,mlflow]'
	touch $@

run: setup
	$(VENV)/bin/tfmoe all

test: setup
	$(VENV)/bin/pytest

test-slow: setup
	$(VENV)/bin/pytest -m slow

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks

bench: setup
	for b in benchmarks/bench_*.py; do echo "== $$b"; $(VENV)/bin/python $$b || exit 1; done

clean:
	rm -rf $(VENV) runs/*/ .pytest_cache
