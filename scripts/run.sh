#!/usr/bin/env bash
# Entry point on every node: `scripts/run.sh --master ...` on one, `scripts/run.sh --worker R ...`
# on the others, with the same --log-path on a shared filesystem. See README.md and `--help`.
# This script only finds the interpreter and sets the environment; Python parses the flags.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
export BATON_PROG="scripts/run.sh"
# Small machines: one BLAS thread per process unless the user says otherwise (docs/design.md §10.2).
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$python" -P -m rl.run_cli "$@"
