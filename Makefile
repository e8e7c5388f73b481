# The two set-up commands of the README. Both start from nothing: `scripts/setup.sh`
# creates .venv and installs everything (idempotent); `scripts/setup_serve.sh` creates .venv-serve,
# SGLang 0.5.23 with the serving install (`pip install ./serving`), the second SGLang line `make test` runs;
# `scripts/setup_vllm.sh` creates .venv-vllm, vLLM's CPU build, which serves `export --to vllm` in tests/vllm_live.
export TORCHDYNAMO_DISABLE ?= 1
export WANDB_MODE ?= disabled
export HF_HUB_OFFLINE ?= 1

.PHONY: setup setup-serve setup-vllm setup-all run test bench

setup:
	bash scripts/setup.sh

setup-serve:
	bash scripts/setup_serve.sh

setup-vllm:
	bash scripts/setup_vllm.sh

# the three environments side by side (scripts/setup_all.sh: each writes its own folder; logs and times in .setup-logs/)
setup-all:
	bash scripts/setup_all.sh

# The main job on the embedded default: SmolLM2-135M on CPU, prepare -> train -> export -> evaluate.
run: setup
	.venv/bin/pr-specforge run $(ARGS)

# The test suite (CPU, tiny random models, serial; both SGLang lines and vLLM: 24 min on 2 emulated AVX2-only cores at 100e508;
# the three environments install side by side first, ~4 min from nothing).
test: setup-all
	PR_SERVE_VENV_REQUIRED=1 .venv/bin/python -m pytest -q tests $(ARGS)

bench: setup
	.venv/bin/python benchmarks/train_step.py --json benchmarks/results/train_step.json
