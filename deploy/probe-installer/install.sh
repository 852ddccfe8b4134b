#!/bin/sh
# Install kvscope's probe into TARGET, a volume that vLLM's container mounts and puts on
# its PYTHONPATH: vLLM then finds the probe's `vllm.general_plugins` entry point and the
# middleware class without any change to vLLM's image. The probe-installer image's
# entrypoint (deploy/probe-installer/Dockerfile); tests/stack/test_kubernetes.py runs it.
#
#   kvscope-probe-install TARGET
#
# Offline (--no-index, from the wheel built into the image). --no-deps: the probe needs
# only msgspec and pyzmq, which vLLM ships, and compiled packages built for this image's
# Python could not load in vLLM's. --no-compile: vLLM's Python may be another version.
# --upgrade: an init container runs again when its pod restarts, into the same volume.
set -eu
target="${1:?usage: kvscope-probe-install TARGET}"
wheels="${KVSCOPE_PROBE_WHEELS:-/wheels}"
python="${PYTHON:-python}"

"$python" -m pip install --quiet --no-index --no-deps --no-compile --upgrade \
  --disable-pip-version-check --no-cache-dir --target "$target" "$wheels"/kvscope_probe-*.whl

# What vLLM will do with that path: find the entry point and import the plugin module
# (stdlib only at import time), with nothing but TARGET and the standard library.
PYTHONPATH="$target" PYTHONDONTWRITEBYTECODE=1 "$python" -S -c '
import importlib.metadata as md, sys
import kvscope_probe.plugin as plugin
target = sys.argv[1]
eps = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "kvscope_probe"]
assert [e.value for e in eps] == ["kvscope_probe.plugin:register"], eps
assert plugin.__file__.startswith(target), plugin.__file__
print("kvscope-probe", md.version("kvscope-probe"), "installed in", target)
' "$target"
