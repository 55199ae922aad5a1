# Two commands (README.md): `make run` sets up and runs every experiment; `make test` sets up and runs the tests.
VENV ?= .venv
comma := ,
PYTHON ?= python3
# The extras `make setup` installs and `make lock` locks (add yours here, then `make lock`).
EXTRAS = dev,hf,mlflow,ray,moe-libs,torchtune,xtransformers
# The lock of the whole environment `make test` uses: pip-compile (pip's own resolver, this machine's pip config:
# the CPU torch wheel) with hashes. Regenerate with `make lock` (keeps the current pins, adds what is new;
# `make lock LOCK_FLAGS=--upgrade` takes the newest allowed releases). See docs/install.md.
LOCK = requirements.lock
LOCK_VENV = .lock-venv
PIP_TOOLS = pip-tools==7.6.2
LOCK_FLAGS ?=
# Where pip finds torch. Empty = the lock's CPU build (on the project's CPU machines a local CPU wheel).
# GPU users: make setup TORCH_INDEX_URL=<PyTorch CUDA wheel index>, see docs/gpu.md: torch comes from there, the
# rest from the lock.
TORCH_INDEX_URL ?=
# The torch the lock holds (and `make lock` keeps, even with --upgrade: pyproject.toml admits a range, and the newest
# release in it is a multi-GB CUDA build). Its CPU build comes from this machine's pip configuration.
TORCH_SPEC = torch==2.13.0

.PHONY: setup lock check-lock run test test-slow test-cluster slurm-up slurm-down lint bench clean
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml $(LOCK)
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
ifeq ($(TORCH_INDEX_URL),)
	$(VENV)/bin/pip install -q --require-hashes --no-deps -r $(LOCK)
	$(VENV)/bin/pip install -q --no-deps --no-build-isolation -e .
	$(VENV)/bin/python scripts/check_lock.py
else
	$(VENV)/bin/pip install -q "$(TORCH_SPEC)" --index-url $(TORCH_INDEX_URL)
	PYTHONPATH=src $(VENV)/bin/python scripts/check_lock.py --without torch > $(VENV)/lock-without-torch.txt
	$(VENV)/bin/pip install -q --require-hashes --no-deps -r $(VENV)/lock-without-torch.txt
	$(VENV)/bin/pip install -q --no-deps --no-build-isolation -e .
	$(VENV)/bin/python scripts/check_lock.py --skip torch
endif
	$(VENV)/bin/pip check
	touch $@

# Regenerate requirements.lock from pyproject.toml (core + EXTRAS), in a venv of its own with a pinned pip-tools.
lock:
	test -x $(LOCK_VENV)/bin/pip-compile || { $(PYTHON) -m venv $(LOCK_VENV) && $(LOCK_VENV)/bin/pip install -q "$(PIP_TOOLS)"; }
	echo "$(TORCH_SPEC)" > $(LOCK_VENV)/torch-constraint.txt
	$(LOCK_VENV)/bin/pip-compile --quiet --generate-hashes --allow-unsafe --strip-extras --no-emit-index-url \
	    --no-emit-find-links $(foreach e,$(subst $(comma), ,$(EXTRAS)),--extra $(e)) $(LOCK_FLAGS) \
	    --constraint $(LOCK_VENV)/torch-constraint.txt --output-file $(LOCK) pyproject.toml

# Does .venv hold exactly the locked versions? (make setup ends with it.)
check-lock: setup
	$(VENV)/bin/python scripts/check_lock.py

run: setup
	$(VENV)/bin/tfmoe all

# pytest-xdist: one worker per core (TEST_WORKERS=auto; 2 on the project's machines), each test module whole in one
# worker (--dist loadfile: a module's fixtures are built once). TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= auto
test: setup
	$(VENV)/bin/pytest -n $(TEST_WORKERS) --dist loadfile

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
	$(VENV)/bin/ruff check src tests benchmarks scripts

bench: setup
	for b in benchmarks/bench_*.py; do echo "== $$b"; $(VENV)/bin/python $$b || exit 1; done

clean:
	rm -rf $(VENV) $(LOCK_VENV) runs/*/ .pytest_cache
