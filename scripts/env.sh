# Sourced by the quick-start scripts: create .venv if missing and install the CPU lock + the project.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
stamp=.venv/.installed-$(cat requirements/cpu.txt pyproject.toml | sha256sum | cut -c1-16)
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if [ ! -f "$stamp" ]; then
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -r requirements/cpu.txt
  .venv/bin/python -m pip install --quiet --no-deps -e .
  rm -f .venv/.installed-*
  touch "$stamp"
fi
export PATH="$PWD/.venv/bin:$PATH"
