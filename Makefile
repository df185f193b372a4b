# pdserve: every command the README mentions. A fresh clone needs nothing but python3.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: setup demo test test-slow lint bench proto model clean sim-fast

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU build of torch (a bare `torch` requirement would pull a multi-GB CUDA build)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $(STAMP)

demo: setup
	$(VENV)/bin/pdserve demo

test: setup
	$(PY) -m pytest -q --durations=20 $(PYTEST_ARGS)

test-slow: setup
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .

bench: setup
	$(VENV)/bin/pdserve study all --quick --out bench/results

proto: setup
	$(PY) -m proto.generate

model: setup
	$(VENV)/bin/pdserve make-model --preset tiny --arch llama --out models/tiny-llama

# opt-in: the simulator's hot modules compiled with mypyc into build/simfast/ (sim/compiled.py);
# `python -m tools.sim_bench_scale` and `pdserve simulate` use it while it matches the source
SIMFAST_MYPY ?= mypy==2.4.1
sim-fast: setup
	$(PY) -m pip install -q '$(SIMFAST_MYPY)'
	$(PY) -m tools.sim_build_fast

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
