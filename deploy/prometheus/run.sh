#!/bin/sh
# Prometheus reads bearer tokens only from its config or a file: write the sidecar's token
# from the environment into a file only this container sees, then start Prometheus.
set -eu
: "${KVSCOPE_TOKEN:?KVSCOPE_TOKEN must be set}"
umask 077
printf '%s' "$KVSCOPE_TOKEN" > /tmp/kvscope_token
unset KVSCOPE_TOKEN
exec /bin/prometheus "$@"
