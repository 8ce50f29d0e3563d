# Developer and CI entry points. `make train` and `make test` create .venv on first use.
#   make train [CONFIG=configs/gpu_small.yaml] [NPROC=2] [ARGS='--set train.steps=100']
# Each `make train` is a new run named <config>-<date>-<time> (RUN), so running it again
# never touches an earlier run's checkpoints/<RUN> or runs/<RUN>. Continue one with
#   make train RUN=tiny-20261124-093000 ARGS=--resume   (ARGS=--overwrite: start it over)
PYTHON ?= python3
NPROC ?= 2
CONFIG ?= configs/tiny.yaml
RUN ?= $(basename $(notdir $(CONFIG)))-$(shell date +%Y%m%d-%H%M%S)
ARGS ?=

VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: venv train test lint

venv: $(STAMP)

# torch is pinned and installed first: left to the resolver, it pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[dev]'
	touch $@

train: venv
	$(BIN)/torchrun --standalone --nproc_per_node=$(NPROC) scripts/train.py --config $(CONFIG) --set name=$(RUN) $(ARGS)

test: venv
	$(BIN)/python -m pytest -q tests

lint: venv
	$(BIN)/ruff check fsdp_lite tests scripts

# Side by side with PyTorch FSDP2, FSDP1 and DDP; writes BENCHMARKS.md and BENCHMARKS.json.
#   make bench [ARGS='--steps 10 --precisions fp32']
.PHONY: bench bench-lora
bench: venv
	$(BIN)/python scripts/bench.py $(ARGS)

# Backward peak memory, full fine-tuning vs a frozen base with LoRA (same Llama, W=2).
bench-lora: venv
	$(BIN)/python scripts/bench_lora.py $(ARGS)
