# Sourced by the scripts that run baton's Python: picks the interpreter ($BATON_PYTHON, else the
# repository's .venv, else python3) and puts the repository on PYTHONPATH.
baton_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${BATON_PYTHON:-}"
if [ -z "$python" ]; then
  if [ -x "$baton_root/.venv/bin/python" ]; then python="$baton_root/.venv/bin/python"; else python="$(command -v python3)"; fi
fi
export PYTHONPATH="$baton_root${PYTHONPATH:+:$PYTHONPATH}"
