# make run / make test bootstrap .venv on a fresh machine, then do their job.
# torch goes in first, pinned, so that no later dependency pulls a CUDA build.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
STAMP := $(VENV)/.installed
export MLFLOW_DISABLE_TELEMETRY := true
export TOKENIZERS_PARALLELISM := false

.PHONY: run test bench clean-outputs venv

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet $(TORCH)
	$(BIN)/pip install --quiet -e '.[dev]' $(TORCH)
	$(BIN)/python -c "from stages.finetune import build_cpu_ops; build_cpu_ops()"  # DeepSpeed's CPU op, ~1 min
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/regraft $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/python bench/vocab_map.py
	$(BIN)/python bench/remap.py

clean-outputs:
	find outputs -mindepth 1 ! -name .gitkeep -exec rm -rf {} +
