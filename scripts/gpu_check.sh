#!/usr/bin/env bash
# GPU check for a machine with one or more NVIDIA GPUs: six checks on cuda:0 (and more GPUs where
# present), one JSON file of results (default out/gpu_check.json; --json PATH to change), within
# 5 minutes. Without a GPU it says so and exits 0. Sets nothing up: it uses the project's .venv when
# present, else python3.
#
#     bash scripts/gpu_check.sh [--json PATH]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=python3
if [ -x "$root/.venv/bin/python" ]; then
  python="$root/.venv/bin/python"
fi
export RAY_USAGE_STATS_ENABLED=0
exec timeout --kill-after=10 300 "$python" "$root/scripts/gpu_check.py" "$@"
