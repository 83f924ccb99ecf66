# Two commands: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export OMP_WAIT_POLICY := PASSIVE

.PHONY: setup demo test clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and alone: the CPU wheel on disk, never a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[bm25,test]'
	touch $(STAMP)

demo: setup
	$(VENV)/bin/agent-rl demo configs/tiny_cpu_grpo.yaml

test: setup
	$(PY) -m pytest -q tests

clean:
	rm -rf runs .cache
