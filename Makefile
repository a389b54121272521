# Two entry points for a fresh machine; both create .venv on their own.
VENV ?= .venv
HONE := $(VENV)/bin/hone

.PHONY: install install-dev install-test quickstart test test-all test-kernels test-gpu lint format clean

install:
	VENV=$(VENV) scripts/install.sh

install-dev:
	VENV=$(VENV) EXTRAS=dev scripts/install.sh

## install-dev, plus triton for the kernel tests' interpreter where no NVIDIA GPU brings one.
install-test:
	VENV=$(VENV) EXTRAS=dev HONE_TRITON_SPEC=$(TRITON_SPEC) scripts/install.sh

## Fine-tune a tiny model on the bundled sample data on CPU (a few minutes), then use it.
quickstart: install
	rm -rf runs/quickstart
	$(HONE) train examples/quickstart.yml
	$(HONE) generate runs/quickstart --prompt "What color is a plum?" --prompt "Which country has Kelmport as its capital?" --prompt "Translate 'house' into Velish."

## The test suite (CPU; GPU tests are skipped without CUDA), in TEST_WORKERS processes (pytest-xdist;
## each test file in one of them), with the Triton kernels in Triton's interpreter: on a machine
## without an NVIDIA GPU the install adds $(TRITON_SPEC) (a CPU torch brings none). Tests marked
## `long` (minutes on two cores: training under the interpreter, multi-process runs that another test
## covers in part) are left out, to keep CI under 20 minutes: `make test-all` runs them too.
## pytest's exit 5 (no tests) fails too.
TEST_WORKERS ?= 2
TRITON_SPEC ?= triton==3.7.1
test: install-test
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not long"

## Every CPU test, the `long` ones included.
test-all: install-test
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

## The Triton kernels alone in Triton's interpreter on the CPU, the `long` cases included.
test-kernels: install-test
	$(VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests/kernels tests/integration/test_expert_lora.py

## Lint and check the formatting (ruff; settings in pyproject.toml). `make format` fixes what it can.
lint: install-dev
	$(VENV)/bin/ruff check hone tests scripts
	$(VENV)/bin/ruff format --check hone tests scripts

format: install-dev
	$(VENV)/bin/ruff check --fix hone tests scripts
	$(VENV)/bin/ruff format hone tests scripts

## On a CUDA machine: only the GPU tests.
test-gpu:
	$(VENV)/bin/python -m pytest -q -m gpu tests/gpu

clean:
	rm -rf runs .pytest_cache
