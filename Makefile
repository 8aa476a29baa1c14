# The two commands of a fresh machine (see README):
#   make demo   set up .venv, build the tiny model+data, train LoRA with real FSDP on 2 CPU processes, verify,
#               reload the adapter and compare it with the base on held-out prompts
#   make test   set up .venv and run the test suite
#   make test-fast  the in-process unit tests alone (under a minute); make lint  ruff over the tree
#   make coverage   the test suite under coverage.py, launched ranks included; prints the report (docs/testing.md)
# TEST_WORKERS: pytest-xdist workers (default 2, the CI machine's cores); each test file runs on one worker, and the
# launches tests share (tests/shared_runs.py) run once for all workers.
PY := .venv/bin/python
# Python keeps the bytecode of the project's own modules and tests in __pycache__ (git-ignored). Some machines set
# PYTHONDONTWRITEBYTECODE=1 (this one does): every launched process then compiled train.py's ~90 sft_recipe modules
# again (~0.07 CPU-s a process, ~400 processes a suite) and every pytest worker rewrote every test file.
unexport PYTHONDONTWRITEBYTECODE
DEMO_DIR ?= runs/demo
TEST_WORKERS ?= 2
PYTEST_ARGS := -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder
PYTEST := $(PY) -m pytest $(PYTEST_ARGS)

.PHONY: setup tiny demo test test-fast coverage lint
setup:
	bash scripts/setup.sh

tiny: setup
	$(PY) -m sft_recipe.tiny --output_dir .tiny

demo: tiny
	bash scripts/demo.sh $(DEMO_DIR)

test: setup
	$(PYTEST) tests

test-fast: setup
	$(PYTEST) -m unit tests

coverage: setup  # the report is printed even when a test fails; the exit status is the tests'
	rm -rf .coverage-data && mkdir .coverage-data
	export COVERAGE_FILE=$(CURDIR)/.coverage-data/.coverage; \
	$(PY) -m coverage run -m pytest $(PYTEST_ARGS) tests; status=$$?; \
	$(PY) -m coverage combine -q .coverage-data && $(PY) -m coverage report; exit $$status

lint: setup
	$(PY) -m ruff check .
