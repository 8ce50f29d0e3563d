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

# The suite on the lowest torch tested: 2.11, the GPU machine's. PyPI's 2.11 is a CUDA
# build (~3 GB in its own venv); it runs on the CPU.
TORCH_MIN ?= 2.11.0
VENV_MIN := .venv-torch-min
.PHONY: test-torch-min
test-torch-min:
	test -x $(VENV_MIN)/bin/python || $(PYTHON) -m venv $(VENV_MIN)
	$(VENV_MIN)/bin/pip install torch==$(TORCH_MIN)
	$(VENV_MIN)/bin/pip install -e '.[dev]'
	$(VENV_MIN)/bin/python -m pytest -q tests

# The CUDA/NCCL paths on one GPU in one command (< 8 min): the CUDA test tier, W=1 NCCL and
# W=2 gloo-on-CUDA against the reference, W=8 fake-PG memory, host syncs, a ~1B Llama bench
# against FSDP2 and the unwrapped model, compiled blocks. Writes gpu_check.md ($OUT/ when set).
# Runs the machine's python3 (the lent GPU machine has torch and no pip); here, a dry run on
# the CPU checks the plumbing: make gpu-check GPU_PYTHON=.venv/bin/python ARGS=--dry-run
GPU_PYTHON ?= python3
.PHONY: gpu-check
gpu-check:
	PYTHONPATH=. $(GPU_PYTHON) tests/gpu/gpu_check.py $(ARGS)

# Where fsdp_lite should lead FSDP2 on a GPU (issue 45): a host-bound deep, narrow Llama
# (tokens/s, host time per unit) and CPU offload (the ~1.1B Llama, then the largest shape
# that trains), about 7 min; writes gpu_measure.md ($OUT/ when set). Dry run here:
#   make gpu-measure GPU_PYTHON=.venv/bin/python ARGS=--dry-run
.PHONY: gpu-measure
gpu-measure:
	PYTHONPATH=. $(GPU_PYTHON) tests/gpu/gpu_check.py --parts hostbound,offload --budget 420 \
		--out $${OUT:-.}/gpu_measure.md $(ARGS)

lint: venv
	$(BIN)/ruff check fsdp_lite tests scripts

# Side by side with PyTorch FSDP2, FSDP1 and DDP: each benchmark is a scenario of
# scripts/bench.py (`bench.py SCENARIO --help` for its flags); those with a block in
# BENCHMARKS.md rewrite it and BENCHMARKS_<scenario>.json (ARGS=--no-write: print only).
#   make bench                    step, host, scale and compile, one after another
#   make bench-step [ARGS='--steps 10 --precisions fp32']   the step at W=2 gloo (~6 min)
#   make bench-accum     8 micro-batches a step, against FSDP2 at its best (~4 min)
#   make bench-2d        fsdp_lite + TP against FSDP2 + TP, tp 2 x dp 2, W=4 (~6 min)
#   make bench-compile   compiled blocks against eager (~5 min)
#   make bench-offload   RSS and step time with CPU and SSD offload (~9 min)
#   make bench-host      host time per unit, fake process group W=8 (~2 min)
#   make bench-scale     per-rank peak of a 1.3B GPT at W=8/64/512, fake PG (~5 min)
#   make bench-lora      backward memory, full vs LoRA; prints only (~30 s)
#   make bench-muon      whole-parameter Muon against FSDP2 + gather; prints only (~3 min)
BENCHES := step accum 2d compile offload host scale lora muon
.PHONY: bench $(addprefix bench-,$(BENCHES))
bench: bench-step bench-host bench-scale bench-compile

$(addprefix bench-,$(BENCHES)): bench-%: venv
	$(BIN)/python scripts/bench.py $* $(ARGS)
