# One command to set up and run the default job (`make train`), one to set up and run the tests (`make test`).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: setup train test bench bench-trl clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@

setup: $(BIN)/.installed

train: setup
	$(BIN)/grpo train $(ARGS)

test: setup
	$(BIN)/python -m pytest -q $(ARGS)

bench: setup
	$(BIN)/python benchmarks/logprobs_memory.py

# ours against TRL's GRPOTrainer on identical work (installs the `bench` extra: TRL and accelerate), then what
# each of our choices is worth, then the accuracy cost of bf16 autocast
bench-trl: setup
	$(BIN)/python -m pip install --quiet -e '.[test,bench]'
	$(BIN)/python benchmarks/vs_trl.py
	$(BIN)/python benchmarks/ablations.py
	$(BIN)/python benchmarks/bf16_accuracy.py

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
