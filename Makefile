# The README's two commands: `make study` (set up, run the main job) and `make test` (set up, test).
PYTHON ?= python3
# torch first, pinned, so that nothing below pulls a different (CUDA) build.
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.klstudy-installed

.PHONY: setup study test

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[test]" --config-settings editable_mode=compat
	touch $(STAMP)

setup: $(STAMP)

# The main job: the toy study, end to end, through Snakemake (see the README, "The study").
study: $(STAMP)
	$(BIN)/snakemake --profile profiles/local

test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest
