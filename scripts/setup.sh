#!/usr/bin/env bash
# Create (or reuse) the project virtualenv and install distpool with its test extra.
# torch==2.13.0 goes in first when torch is missing, so that the package's torch range is then already
# satisfied and never pulls a newer build. Which build the pin takes is pip's choice: plain PyPI on
# Linux x86_64 serves the CUDA build (several GB); TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# takes the CPU build instead; a machine whose pip finds a local CPU wheel (find-links) takes that.
set -euo pipefail
venv=${1:-.venv}
python=${PYTHON:-python3}
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  torch_source=()
  [ -n "${TORCH_INDEX_URL:-}" ] && torch_source=(--index-url "$TORCH_INDEX_URL")
  echo "setup: installing torch==2.13.0${TORCH_INDEX_URL:+ from $TORCH_INDEX_URL}"
  "${pip[@]}" install -q "${torch_source[@]}" "torch==2.13.0"
fi
echo "setup: installing distpool[test,dev]"
"${pip[@]}" install -q -e ".[test,dev]"
