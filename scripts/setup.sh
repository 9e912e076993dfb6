#!/usr/bin/env bash
# Create (or reuse) the project virtualenv and install distpool with its test extra.
# torch==2.13.0 goes in first when torch is missing: on CPU-only machines that pin resolves to the
# local CPU wheel, and the package's torch range is then already satisfied.
set -euo pipefail
venv=${1:-.venv}
python=${PYTHON:-python3}
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  echo "setup: installing torch==2.13.0"
  "${pip[@]}" install -q "torch==2.13.0"
fi
echo "setup: installing distpool[test,dev]"
"${pip[@]}" install -q -e ".[test,dev]"
