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

# The test suite (CPU, tiny random models), on two pytest-xdist workers: one takes the live SGLang tests
# (they share one trained run and one plain server), the other the rest, slowest modules first (tests/conftest.py).
test: setup
	.venv/bin/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder tests $(ARGS)

bench: setup
	.venv/bin/python benchmarks/train_step.py --json benchmarks/results/train_step.json
