# Quick start: `make demo` (compile tiny BERT and LSTM on the CPU, print the comparison table)
#              `make test` (the whole test suite, CPU only)
#              `make corpus` (export the real-model corpus; `make bench-corpus` measures it)
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

# pytest workers (pytest-xdist): two for the two cores CI has; TEST_WORKERS=0 runs in one process
TEST_WORKERS ?= 2

CORPUS_STAMP := $(VENV)/.corpus-installed
CORPUS ?= .souffle_cache/corpus
# pip options for the corpus extra, e.g. an index with CPU-only torch wheels (PyPI's pull in CUDA)
CORPUS_PIP ?=

.PHONY: demo test install bench-deps clean corpus bench-corpus

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

# tests/test_targets.py links aarch64 libraries with aarch64-linux-gnu-gcc (apt-get install gcc-aarch64-linux-gnu);
# without it those tests skip, saying so
test: $(STAMP)   # SOUFFLE_STRICT=1: a failing schedule rule or TE pass is an error (souffle_py/failures.py)
	SOUFFLE_STRICT=1 $(PY) -m pytest -q -n $(TEST_WORKERS) tests

$(CORPUS_STAMP): pyproject.toml $(STAMP)
	$(PY) -m pip install --quiet $(CORPUS_PIP) -e '.[corpus,bench]'
	touch $(CORPUS_STAMP)

corpus: $(CORPUS_STAMP)
	$(PY) scripts/corpus.py --out $(CORPUS)

bench-corpus: corpus
	$(PY) scripts/bench_corpus.py --corpus $(CORPUS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
