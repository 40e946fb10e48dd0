# `make test` and `make demo` do all set-up on a fresh clone.
VENV  := .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export DS_ACCELERATOR ?= cpu
export TOKENIZERS_PARALLELISM := false

.PHONY: setup test demo lint clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	# torch first: the pinned CPU wheel; an unpinned torch would pull a CUDA build of several GB.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test,bench]"
	touch $(STAMP)

setup: $(STAMP)

test: setup
	$(VENV)/bin/ruff check posttrain tests examples benchmarks
	$(PY) -m pytest tests

# The main job: PPO on the built-in tiny default, two processes on this CPU.
demo: setup
	$(VENV)/bin/accelerate launch --config_file configs/accelerate/cpu_2proc.yaml examples/ppo.py

lint: setup
	$(VENV)/bin/ruff check posttrain tests examples benchmarks

clean:
	rm -rf $(VENV) .cache runs
