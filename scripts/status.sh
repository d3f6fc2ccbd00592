#!/usr/bin/env bash
# Thin wrapper: python -m coordination status --log-path L [...] (see --help).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec "$python" -m coordination status "$@"
