#!/usr/bin/env bash
# Debian packages the tests drive for real: headless Chromium (the /ui page),
# Prometheus, promtool and Alertmanager (rules and the stack). Installs only what is
# missing; needs root (or sudo). Never downloads a browser of its own. kubectl (the
# Kubernetes tests render the manifests with `kubectl kustomize`) comes with no Debian
# package: its absence stops here, said plainly, rather than in the middle of the tests.
set -euo pipefail
if ! command -v kubectl >/dev/null; then
    echo "kubectl is not on the PATH: the Kubernetes tests run 'kubectl kustomize';" \
         "install kubectl (https://kubernetes.io/docs/tasks/tools/) and run this again" >&2
    exit 1
fi
need=()
command -v chromium >/dev/null || need+=(chromium)
command -v prometheus >/dev/null || need+=(prometheus)
command -v promtool >/dev/null || need+=(prometheus)
command -v prometheus-alertmanager >/dev/null || need+=(prometheus-alertmanager)
[[ ${#need[@]} -eq 0 ]] && exit 0
SUDO=""
[[ $(id -u) -ne 0 ]] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
