# Sourced by the quick-start scripts: create the lane's venv if missing and install its CPU lock + the project.
#   PARITY_LOCK   the lock to install (default requirements/cpu.txt, the latest stack;
#                 requirements/cpu-lowest.txt is the lowest stack the declared ranges allow)
#   PARITY_VENV   where that lane's virtual environment lives (default .venv)
#   PARITY_REPORT_DIR  where the report goes (default reports)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
PARITY_LOCK="${PARITY_LOCK:-requirements/cpu.txt}"
PARITY_VENV="${PARITY_VENV:-.venv}"
PARITY_REPORT_DIR="${PARITY_REPORT_DIR:-reports}"
if [ ! -f "$PARITY_LOCK" ]; then
  echo "env.sh: no lock file $PARITY_LOCK (expected requirements/cpu.txt or requirements/cpu-lowest.txt)" >&2
  exit 2
fi
# pytest rewrites the asserts of ~290 modules at every start; with bytecode kept (__pycache__, git-ignored) it reads
# them back instead, about 6 s less per run after the first on 2 cores. Mutants are patched in memory, never on disk.
unset PYTHONDONTWRITEBYTECODE
stamp="$PARITY_VENV/.installed-$(cat "$PARITY_LOCK" pyproject.toml | sha256sum | cut -c1-16)"
if [ ! -x "$PARITY_VENV/bin/python" ]; then
  "$PYTHON" -m venv "$PARITY_VENV"
fi
if [ ! -f "$stamp" ]; then
  "$PARITY_VENV/bin/python" -m pip install --quiet --upgrade pip
  # --no-compile: pip would compile every module of the lock, transformers' and diffusers' whole model zoos
  # included (about 38 of an install's 68 CPU-s); a module is compiled at its first import instead, and kept. What
  # every run imports is compiled here, once, rather than by each of CI's streams at the same time.
  "$PARITY_VENV/bin/python" -m pip install --quiet --no-compile -r "$PARITY_LOCK"
  "$PARITY_VENV/bin/python" -m pip install --quiet --no-compile --no-deps -e .
  "$PARITY_VENV/bin/python" -c "import torch, transformers, diffusers"
  rm -f "$PARITY_VENV"/.installed-*
  touch "$stamp"
fi
export PATH="$PWD/$PARITY_VENV/bin:$PATH"
export PARITY_REPORT_DIR
