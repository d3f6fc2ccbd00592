#!/usr/bin/env bash
# Set up (or update) the project's virtualenv from its own requirement files and run the tests.
#
#   bash scripts/test.sh            default tier: unit tests and the fast real multi-process tests
#   bash scripts/test.sh --all      also the heavy tiers: end-to-end runs (slow), vLLM on CPU (vllm),
#                                   network namespaces (netns, needs root and iproute2), network
#                                   filesystems (netfs: sshfs over loopback, needs root and FUSE)
#   bash scripts/test.sh [--all] -- <pytest args>   pass extra arguments to pytest
set -euo pipefail
cd "$(dirname "$0")/.."

all=0
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --all) all=1; shift ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) echo "scripts/test.sh: unknown argument '$1' (use --all, or -- before pytest arguments)" >&2; exit 2 ;;
  esac
done

source scripts/venv.sh
ensure_project_venv

markers="not slow and not vllm and not netns and not netfs"
if [ "$all" = 1 ]; then
  ensure_vllm_venv .venv-vllm
  export BATON_VLLM_PYTHON="$PWD/.venv-vllm/bin/python"
  markers=""
fi

set +e
.venv/bin/python -m pytest ${markers:+-m "$markers"} "${extra[@]}"
rc=$?
set -e
# Exit code 5 means pytest collected nothing: a selection that matches no test is a broken
# test command, not a pass.
if [ "$rc" = 5 ]; then
  echo "scripts/test.sh: pytest collected no tests for this selection; failing on purpose" >&2
  exit 1
fi
exit "$rc"
