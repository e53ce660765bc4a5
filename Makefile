# DFlash drafter training on Proxmox GPU hosts. `make help` lists the entry points.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

INVENTORY ?= inventory/lab
VENV := $(CURDIR)/.venv
TRAINER_VENV := $(CURDIR)/.venv-trainer
PY := $(VENV)/bin/python
export PATH := $(VENV)/bin:$(PATH)
export ANSIBLE_CONFIG := $(CURDIR)/ansible/ansible.cfg
export PYTHONUNBUFFERED := 1
# The venvs are installed without bytecode (pip's compile of all 37,000 files was most of a fresh bootstrap);
# each module is compiled when first imported and kept, which PYTHONDONTWRITEBYTECODE=1 (set on some
# machines) would turn into a compile at every start of every tool.
unexport PYTHONDONTWRITEBYTECODE

# Checks the inventory before any play: a missing path or a malformed file is one line naming it.
CHECK_INVENTORY = $(PY) scripts/check_inventory.py $(INVENTORY)

.PHONY: help
help: ## list the entry points
	@awk 'BEGIN {FS = ":.*## "} /^[a-z][a-z0-9-]*:.*## / {printf "  %-18s %s\n", $$1, $$2}' $(MAKEFILE_LIST)
	@echo "  INVENTORY=$(INVENTORY) (default inventory/lab)"

.PHONY: bootstrap
bootstrap: ## install Debian packages and the two pinned venvs (.venv, .venv-trainer); seconds when nothing changed
	@scripts/bootstrap.sh

.PHONY: lint
lint: bootstrap ## ansible-lint (production profile), yamllint, ruff, the mypy gate (errors per file only shrink)
	yamllint -s .
	ansible-lint --profile production --offline -q
	ruff check .
	ruff format --check .
	$(PY) scripts/mypy_gate.py

.PHONY: pre-commit-install
pre-commit-install: bootstrap ## run ruff, yamllint and the mypy gate before each commit (.pre-commit-config.yaml)
	pre-commit install

# The trainer's tests run in a TMPDIR of their own: torchrun's agents leave /tmp/torchelastic_* behind.
TRAINER_PYTEST = tmp=$$(mktemp -d /tmp/dflash-trainer-tests.XXXXXX); trap 'rm -rf "$$tmp"' EXIT; \
  TMPDIR=$$tmp $(TRAINER_VENV)/bin/python -m pytest -q
# The repository's tests that need neither the lab nor root.
UNIT_TESTS := tests/inventory tests/tooling
# Markers, the same in both suites: slow (left out of `make test`: test-slow), system (the trainer as processes
# or with root's powers: after the lab in `make test`), gpu (test-gpu). pytest exits 5 when no test carries the
# marker asked for.
NO_TESTS_IS_OK = || [ $$? = 5 ]

.PHONY: test
test: bootstrap lint test-unit lab ## everything CI runs: lint, unit tests, the lab, system tests, molecule, the two-CT lab
	$(TRAINER_PYTEST) -m "system and not gpu and not slow" trainer/tests
	$(PY) -m pytest -q -m "not slow" tests/lab tests/molecule
	scripts/molecule_all.sh
	$(PY) -m pytest -q -m "not slow" tests/l0_l1_host tests/l2_container tests/l3_environment tests/l4_data tests/image tests/l5_service
	$(PY) -m pytest -q -m "not slow" tests/l5_alerts
	$(MAKE) --no-print-directory test-multinode

# Root bootstraps (Debian packages, the venvs); another user runs the unit tests in the venvs root built.
UNIT_VENVS := $(if $(filter 0,$(shell id -u)),bootstrap,venvs-built)
.PHONY: venvs-built
venvs-built:
	@for v in $(VENV) $(TRAINER_VENV); do \
	  [ -x $$v/bin/python ] || { echo "$$v is missing: run 'make bootstrap' as root once" >&2; exit 1; }; done

.PHONY: test-unit
test-unit: $(UNIT_VENVS) ## the fast loop: the trainer's tests but gpu/system/slow ones, and the tooling's; no lab, no root
	$(TRAINER_PYTEST) -n 2 -m "not gpu and not system and not slow" trainer/tests
	$(PY) -m pytest -q -m "not slow" $(UNIT_TESTS)

.PHONY: test-slow
test-slow: bootstrap lab ## the long checks: slow molecule scenarios (DKMS build) and slow tests
	$(TRAINER_PYTEST) -m "slow and not gpu" trainer/tests $(NO_TESTS_IS_OK)
	$(PY) -m pytest -q -m slow tests
	scripts/molecule_all.sh --slow

# The GPU tests' interpreter: the trainer venv (TRAINER_LOCK=trainer/requirements-cuda.lock make bootstrap), or
# any Python with the trainer's CUDA requirements and the trainer on its path (GPU_PYTHON=python3).
GPU_PYTHON ?= $(TRAINER_VENV)/bin/python

.PHONY: test-gpu
test-gpu: ## the trainer's GPU tests (-m gpu); refuses without CUDA; GPU_PYTHON=python3 for another interpreter
	@$(GPU_PYTHON) -c 'import torch, sys; torch.cuda.is_available() or sys.exit(f"test-gpu: no CUDA device: torch {torch.__version__} of {sys.executable} says torch.cuda.is_available() is False; run it on a GPU machine")'
	$(GPU_PYTHON) -m pytest -q -m gpu trainer/tests

.PHONY: test-multinode
test-multinode: bootstrap ## the two-CT lab of one job (inventory/lab-multinode): build, provision, tests, smoke run
	$(MAKE) --no-print-directory lab LAB_INVENTORY=inventory/lab-multinode
	$(MAKE) --no-print-directory provision INVENTORY=inventory/lab-multinode
	$(PY) -m pytest -q tests/multinode
	$(PY) -m pytest -q tests/verify --inventory inventory/lab-multinode
	$(MAKE) --no-print-directory smoke-train INVENTORY=inventory/lab-multinode

.PHONY: lab
# The lab to build: inventory/lab (one CT), or inventory/lab-multinode (two CTs of one job).
LAB_INVENTORY ?= inventory/lab

lab: bootstrap ## build or repair the local lab (containers, fakepve, S3); changes nothing when up
	$(PY) -m lab up --inventory $(LAB_INVENTORY)

.PHONY: lab-down
lab-down: ## remove every container, process, listener and file the lab made
	@if [ -x $(PY) ]; then $(PY) -m lab down; else echo "lab-down: no venv, so no lab was built by it"; fi

.PHONY: lab-status
lab-status: bootstrap ## print each part of the lab and whether it is up
	$(PY) -m lab status --inventory $(LAB_INVENTORY)

.PHONY: provision
provision: bootstrap ## run ansible/site.yml against INVENTORY, layer by layer (VERIFY=all: every layer's checks)
	@$(CHECK_INVENTORY)
	ansible-playbook -i $(INVENTORY) ansible/site.yml $(if $(TAGS),--tags $(TAGS)) \
	  $(if $(filter all,$(VERIFY)),-e verify_skip_unchanged=false)

.PHONY: verify
verify: bootstrap ## run the testinfra layer checks against INVENTORY, in layer order
	@$(CHECK_INVENTORY)
	$(PY) -m pytest -v tests/verify --inventory $(INVENTORY)

# When make read this file: the smoke summary's clock starts when `make smoke-train` was typed, before bootstrap.
SMOKE_T0 := $(or $(DFLASH_SMOKE_T0),$(shell date +%s.%N))

.PHONY: smoke-train
smoke-train: bootstrap ## 100-step warmup as a transient unit in INVENTORY's container
	@$(CHECK_INVENTORY)
	INVENTORY=$(INVENTORY) DFLASH_SMOKE_T0=$(SMOKE_T0) scripts/smoke_train.sh

.PHONY: status
status: bootstrap ## the training unit of INVENTORY's CT on one screen (state, step, tokens/s, ETA, checkpoint, last failure)
	@$(CHECK_INVENTORY)
	INVENTORY=$(INVENTORY) scripts/status.sh

.PHONY: tensorboard
tensorboard: bootstrap ## the training curves of INVENTORY's CT at http://127.0.0.1:6006/ (PORT=N)
	INVENTORY=$(INVENTORY) scripts/tensorboard.sh

.PHONY: logs
logs: bootstrap ## follow the dflash-train journal in INVENTORY's container
	@$(CHECK_INVENTORY)
	INVENTORY=$(INVENTORY) scripts/logs.sh

VARIANT ?= cpu

.PHONY: image
image: bootstrap ## build the CT template (VARIANT=cpu|cuda); prints its path and volid
	image/build.sh $(VARIANT)

.PHONY: image-pins
image-pins: bootstrap ## re-resolve image/packages.in into image/packages.txt; review the diff
	image/build.sh --refresh-pins

.PHONY: bench
bench: bootstrap lab ## CPU sizes of every benchmark (figures, no assertions); GPU sizes: scripts/gpu_bench.sh
	$(TRAINER_VENV)/bin/python trainer/bench/bench_drafter.py --device cpu --out build/bench/drafter-cpu.json
	$(TRAINER_VENV)/bin/python trainer/bench/bench_pipeline.py --size tiny --cpu --out build/bench/pipeline-cpu.json
	$(TRAINER_VENV)/bin/python trainer/bench/bench_load.py --size-gb 0.2 --device cpu
	$(PY) trainer/bench/bench_sync.py

.PHONY: lock
lock: ## re-resolve the locks in clean venvs; review the diff, upgrades are on purpose
	scripts/lock.sh
