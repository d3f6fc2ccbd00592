#!/usr/bin/env bash
# Thin wrapper: python -m coordination recover --log-path L [...] (see --help).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
export BATON_PROG="scripts/recover.sh"
exec "$python" -P -m coordination recover "$@"
