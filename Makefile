# The two commands of a fresh machine (see README):
#   make demo   set up .venv, build the tiny model+data, train LoRA with real FSDP on 2 CPU processes, verify,
#               reload the adapter and compare it with the base on held-out prompts
#   make test   set up .venv and run the test suite
#   make test-fast  the in-process unit tests alone (under 2 minutes); make lint  ruff over the tree
PY := .venv/bin/python
DEMO_DIR ?= runs/demo

.PHONY: setup tiny demo test test-fast lint
setup:
	bash scripts/setup.sh

tiny: setup
	$(PY) -m sft_recipe.tiny --output_dir .tiny

demo: tiny
	bash scripts/demo.sh $(DEMO_DIR)

test: setup
	$(PY) -m pytest -q tests

test-fast: setup
	$(PY) -m pytest -q -m unit tests

lint: setup
	$(PY) -m ruff check .
