# Two commands (README): `make run` sets up and runs every experiment; `make test` sets up and runs the tests.
VENV ?= .venv
PYTHON ?= python3
# Where pip finds torch. Empty = the default index (on the project's CPU machines a local CPU wheel).
# GPU users: make setup TORCH_INDEX_URL=<PyTorch CUDA wheel index>, see README "GPU install".
TORCH_INDEX_URL ?=
TORCH_SPEC = torch==2.13.0

.PHONY: setup run test test-slow test-cluster slurm-up slurm-down lint bench clean
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q "$(TORCH_SPEC)" $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	$(VENV)/bin/pip install -q "$(TORCH_SPEC)" -e '.[dev,hf,mlflow,ray,moe-libs,torchtune,xtransformers]' $(if $(TORCH_INDEX_URL),--extra-index-url $(TORCH_INDEX_URL))
	touch $@

run: setup
	$(VENV)/bin/tfmoe all

test: setup
	$(VENV)/bin/pytest

test-slow: setup
	$(VENV)/bin/pytest -m slow

# A real single-node SLURM cluster on this machine (root; Debian's slurmctld/slurmd/slurmdbd, munge, MariaDB).
slurm-up:
	bash scripts/slurm-up.sh

slurm-down:
	bash scripts/slurm-down.sh

# The cluster tests (pytest -m cluster) between slurm-up and slurm-down; the cluster is stopped even if they fail.
test-cluster: setup
	bash scripts/slurm-up.sh
	$(VENV)/bin/pytest -m cluster; rc=$$?; bash scripts/slurm-down.sh || rc=1; exit $$rc

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks

bench: setup
	for b in benchmarks/bench_*.py; do echo "== $$b"; $(VENV)/bin/python $$b || exit 1; done

clean:
	rm -rf $(VENV) runs/*/ .pytest_cache
