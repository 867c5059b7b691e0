# Quick start: `make demo` (compile tiny BERT and LSTM on the CPU, print the comparison table)
#              `make test` (the whole test suite, CPU only)
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test install bench-deps clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

bench-deps: $(STAMP)   # OpenVINO, the benchmark tables' f32 and default-precision (bf16) anchors
	$(PY) -m pip install --quiet -e '.[test,bench]'

demo: $(STAMP)
	$(PY) scripts/bench.py --tiny

test: $(STAMP)
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
