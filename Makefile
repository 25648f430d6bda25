# slurmft: set-up, tests, benchmarks. Run as root on Debian 12 (make install uses apt-get).
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# A CPU build of this exact version lies on disk on our machines; an open range pulls CUDA.
TORCH_SPEC ?= torch==2.13.0
# debootstrap and iproute2 (ip): the Slurm release matrix that make test ends with. prometheus:
# its promtool checks and unit-tests the alert rules in deploy/prometheus/ (tests/unit/test_alert_rules.py).
# gcc and libc6-dev: tests/unit/test_warm_cuda_driver.py builds a stand-in CUDA driver library.
DEBIAN_PKGS := slurm-wlm slurmdbd munge mariadb-server debootstrap iproute2 prometheus gcc libc6-dev
PYTEST_ARGS ?=
# Python caches compiled modules (__pycache__) unless PYTHONDONTWRITEBYTECODE is set, as it is on our
# CI machines: then each of a test run's ~1,500 Python processes (CLI calls, tasks, agents) compiled
# what it imports of slurmft/ again (0.01-0.04 CPU-s each) and each pytest process rewrote and
# compiled every test module again (its collection 11.5 CPU-s, 5.3 with the cache). Not in this
# Makefile's recipes: ~70 CPU-s of a test run.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install system-deps venv docs demo test test-unit test-integration test-matrix bench lint clean

install: system-deps venv

system-deps:
	@missing=""; for p in $(DEBIAN_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" != 0 ]; then echo "make install: need root to apt-get install:$$missing" >&2; exit 1; fi; \
	  echo "installing Debian packages:$$missing"; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing; \
	fi

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[train,dev,plot,docs]"
	touch $@

# The main job: a real training job on a throwaway 4-node devcluster under slurmft watch, through
# a node death, a hang, a crash, a corrupted checkpoint, a time-limit signal and a failing health
# check; then slurmft status, its timeline PNG, and the losses against an uninterrupted run.
demo: venv
	$(PY) examples/demo.py

# The user guide: docs/ built by MkDocs (mkdocs.yml) into build/site, strictly: a broken link or
# anchor, or a page missing from the nav, fails it. A second or two; the first step of make test
# after the lint (tests/unit/test_docs.py checks the pages' examples and configuration reference).
# Not -q: mkdocs (1.6) then drops its warnings before --strict counts them, and passes a broken link.
docs: venv
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# The lint first (ruff and mypy, see lint): a finding fails make test before any test runs.
# pytest exits 5 when it collected nothing: that is a failure for us, not a pass. Then the Slurm
# client's tests on Debian's newer Slurm releases (matrix/run.sh, see test-matrix); 22.05, the
# host's own, runs in the suite. TEST_MATRIX_SUITES= leaves the matrix out.
# pytest runs in TEST_WORKERS parallel workers (pytest-xdist; TEST_WORKERS=0: one process), each
# with its own devcluster, in a random order (pytest-randomly prints its seed;
# PYTEST_ARGS=--randomly-seed=N repeats an order, PYTEST_ARGS="-p no:randomly" keeps the files').
# loadgroup: the tests of one xdist_group (a module-scoped world, tests/conftest.py) go to one worker.
# Six workers: since the tiny model's steps cost half the CPU (2026-11-29) four kept the 2 cores
# only ~1.5 busy, five ~1.66, the run bound by its tests' waits (their wall times summed, over the
# workers).
TEST_MATRIX_SUITES ?= trixie sid
TEST_WORKERS ?= 6
XDIST = -n $(TEST_WORKERS) --dist loadgroup
# The matrix runs beside pytest, not after it (matrix/beside.sh): both mostly wait on daemons and
# timers; its output goes to build/matrix.log and is printed whole after pytest's.
test: venv lint docs
	matrix/beside.sh "$(TEST_MATRIX_SUITES)" build/matrix.log -- \
	  $(PY) -m pytest -q $(XDIST) --durations=40 $(PYTEST_ARGS)

test-unit: venv
	$(PY) -m pytest -q $(XDIST) -m "not integration" $(PYTEST_ARGS)

test-integration: venv
	$(PY) -m pytest -q $(XDIST) -m integration $(PYTEST_ARGS)

# The Slurm integration tests on Debian's 22.05 (bookworm), 24.11 (trixie) and 26.05 (sid), each in
# a debootstrapped rootfs cached outside the repo (matrix/run.sh says how). MATRIX_SUITES=trixie
# runs one. Needs root, debootstrap and the network on the first run.
MATRIX_SUITES ?=
test-matrix:
	matrix/run.sh $(MATRIX_SUITES)

# ruff (pycodestyle + pyflakes) on all Python and mypy on slurmft/, configured in pyproject.toml; the first step
# of `make test`. The lint extra goes into this venv only (the matrix venvs take core + dev), once
# per change of pyproject.toml.
lint: $(VENV)/.lint-installed
	$(VENV)/bin/ruff check slurmft tests benchmarks examples matrix
	$(VENV)/bin/mypy

$(VENV)/.lint-installed: $(VENV)/.installed
	$(PIP) install -q -e ".[lint]"
	touch $@

bench: venv
	@for b in benchmarks/*_bench.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
