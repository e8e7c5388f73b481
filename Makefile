# The two set-up commands of the README. Both start from nothing: `scripts/setup.sh`
# creates .venv and installs everything (idempotent).
export TORCHDYNAMO_DISABLE ?= 1
export WANDB_MODE ?= disabled
export HF_HUB_OFFLINE ?= 1

.PHONY: setup run test bench

setup:
	bash scripts/setup.sh

# The main job on the embedded default: SmolLM2-135M on CPU, prepare -> train -> export -> evaluate.
run: setup
	.venv/bin/pr-specforge run $(ARGS)

# The test suite (CPU, tiny random models, serial; 15 min of tests on 2 quiet cores at 262a00d, 879 s).
test: setup
	.venv/bin/python -m pytest -q tests $(ARGS)

bench: setup
	.venv/bin/python benchmarks/train_step.py --json benchmarks/results/train_step.json
