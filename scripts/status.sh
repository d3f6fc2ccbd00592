#!/usr/bin/env bash
# Thin wrapper: python -m coordination status --log-path L [...] (see --help).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
export BATON_PROG="scripts/status.sh"
exec "$python" -P -m coordination status "$@"
