#!/usr/bin/env bash
# The GPU check's entry point: bench/gpu_check.py (the parts, the plan, the runner) under
# PYTHON (default python3), which also runs every part.
#   bash bench/gpu_check.sh [--cpu-smoke] [--plan]
PY=${PYTHON:-python3}
if ! command -v "$PY" >/dev/null; then
    said="gpu_check: no python at PYTHON=$PY; set PYTHON=/path/to/python"
    echo "$said" >&2
    if [ -n "${OUT:-}" ] && mkdir -p "$OUT" 2>/dev/null; then echo "$said" >"$OUT/gpu_check.log"; fi
    exit 2
fi
PYTHON=$PY exec "$PY" "$(dirname "$0")/gpu_check.py" "$@"
