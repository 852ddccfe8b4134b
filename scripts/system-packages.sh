#!/usr/bin/env bash
# Debian packages the tests drive for real: headless Chromium (the /ui page),
# Prometheus, promtool and Alertmanager (rules and the stack). Installs only what is
# missing; needs root (or sudo). Never downloads a browser of its own.
set -euo pipefail
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
