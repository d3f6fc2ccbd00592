# Sourced by the scripts that run baton's Python: picks the interpreter ($BATON_PYTHON, else the
# repository's .venv, else python3) and puts the repository first on PYTHONPATH. The folder the
# user runs from is never on the import path: the wrappers run `python -P`, and PYTHONSAFEPATH=1
# does the same for every Python child (torchrun, trainers, servers), so a stray click.py or
# torch.py in the current folder cannot run as baton (Python 3.11+).
baton_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${BATON_PYTHON:-}"
if [ -z "$python" ]; then
  if [ -x "$baton_root/.venv/bin/python" ]; then python="$baton_root/.venv/bin/python"; else python="$(command -v python3)"; fi
fi
# Python reads an empty PYTHONPATH entry (a leading, trailing or doubled ':') as the current
# folder, which -P does not remove: keep only the non-empty entries.
baton_path="$baton_root"
IFS=':' read -r -a baton_entries <<< "${PYTHONPATH:-}"
for entry in ${baton_entries[@]+"${baton_entries[@]}"}; do
  if [ -n "$entry" ]; then baton_path="$baton_path:$entry"; fi
done
export PYTHONPATH="$baton_path"
export PYTHONSAFEPATH=1
if ! "$python" -P -c '' 2>/dev/null; then
  echo "baton needs Python 3.11 or newer (for python -P); $python is older. Set BATON_PYTHON to a newer interpreter." >&2
  exit 2
fi
