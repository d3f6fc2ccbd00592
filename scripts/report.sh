#!/usr/bin/env bash
# Thin wrapper: python -m coordination report --log-path L [...] (see --help).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${BATON_PYTHON:-}"
if [ -z "$python" ]; then
  if [ -x "$here/.venv/bin/python" ]; then python="$here/.venv/bin/python"; else python="$(command -v python3)"; fi
fi
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" -m coordination report "$@"
