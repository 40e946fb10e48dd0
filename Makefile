# `make test` and `make demo` do all set-up on a fresh clone.
VENV  := .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export DS_ACCELERATOR ?= cpu
export TOKENIZERS_PARALLELISM := false

.PHONY: setup test demo pipeline lint clean

$(STAMP): pyproject.toml
	@echo "set-up 1/3: a virtual environment in $(VENV)"
	python3 -m venv $(VENV)
	# torch first: the pinned CPU wheel; an unpinned torch would pull a CUDA build of several GB.
	@echo "set-up 2/3: torch 2.13.0, the CPU wheel (about 30 s)"
	@start=$$(date +%s) && $(PY) -m pip install -q torch==2.13.0 && echo "  done in $$(( $$(date +%s) - start )) s"
	@echo "set-up 3/3: posttrain and its dependencies, editable (about 50 s)"
	@start=$$(date +%s) && $(PY) -m pip install -q -e ".[test,bench]" && echo "  done in $$(( $$(date +%s) - start )) s"
	touch $(STAMP)

setup: $(STAMP)

test: setup
	$(VENV)/bin/ruff check posttrain tests examples benchmarks
	$(PY) -m pytest tests

# The main job: PPO on the built-in tiny default (shipped prebuilt in posttrain/demo/data/tiny), two
# processes on this CPU.
demo: setup
	@echo "demo: PPO on the tiny default, 2 processes on this CPU, 64 updates (about a minute)"
	$(VENV)/bin/accelerate launch --config_file configs/accelerate/cpu_2proc.yaml examples/ppo.py

# The whole RLHF pipeline: SFT -> reward model -> GRPO, each stage's saved model the next stage's
# input, two processes on this CPU per stage.
pipeline: setup
	@echo "pipeline: SFT -> reward model -> GRPO on the tiny default, 2 processes on this CPU (about 2 minutes)"
	$(PY) examples/pipeline.py

lint: setup
	$(VENV)/bin/ruff check posttrain tests examples benchmarks

clean:
	rm -rf $(VENV) .cache runs
