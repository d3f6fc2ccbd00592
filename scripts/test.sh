#!/usr/bin/env bash
# Set up (or update) the project's virtualenv from its own requirement files and run the tests.
#
#   bash scripts/test.sh            default tier: unit tests and the fast real multi-process tests
#   bash scripts/test.sh --all      also the heavy tiers: end-to-end runs (slow), vLLM on CPU (vllm),
#                                   network namespaces (netns, needs root and iproute2), network
#                                   filesystems (netfs: sshfs over loopback, needs root and FUSE)
#   bash scripts/test.sh --gpu      only the gpu tier, on a node with a CUDA GPU: FSDP2 + NCCL in
#                                   bf16, sharded load and publication that vLLM serves, sleep, wake
#                                   and reload, the memory plan against measured peak memory
#                                   (installs requirements-gpu.txt into .venv once)
#   bash scripts/test.sh [--all|--gpu] -- <pytest args>   pass extra arguments to pytest
set -euo pipefail
cd "$(dirname "$0")/.."

all=0
gpu=0
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --all) all=1; shift ;;
    --gpu) gpu=1; shift ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "scripts/test.sh: unknown argument '$1' (use --all or --gpu, or -- before pytest arguments)" >&2; exit 2 ;;
  esac
done
if [ "$all" = 1 ] && [ "$gpu" = 1 ]; then
  echo "scripts/test.sh: --all and --gpu are separate runs (--all skips the gpu tier without CUDA); give one" >&2
  exit 2
fi

source scripts/venv.sh
ensure_project_venv

markers="not slow and not vllm and not netns and not netfs and not gpu"
if [ "$gpu" = 1 ]; then
  if ! .venv/bin/python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    echo "scripts/test.sh --gpu: .venv's torch sees no CUDA GPU (torch.cuda.is_available() is False); run it on a" \
         "GPU node, where pip's torch==2.13.0 is the CUDA 13 build; it and vLLM 0.32's kernels need an NVIDIA" \
         "driver >= 580 (nvidia-smi shows yours)" >&2
    exit 2
  fi
  ensure_gpu_packages
  markers="gpu"
elif [ "$all" = 1 ]; then
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
