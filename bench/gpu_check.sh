#!/usr/bin/env bash
# The GPU check for a machine with one CUDA GPU (README "GPU check"): installs what it needs (qlm itself with
# --no-deps, flash-attn if it installs, else the torch-native kernels), runs each check under its own timeout and
# prints one summary table (also OUT/gpu_check.md and OUT/gpu_check.json; OUT: $OUT if set, else runs/gpu_check).
#   bench/gpu_check.sh              # everything, under 10 minutes
#   bench/gpu_check.sh --dry-run    # print every command and exit 0 (without CUDA: the same list, then exit 2)
# The checks and what each proves: bench/gpu_check.py; uses $PYTHON, else the python on PATH.
set -u
cd "$(dirname "$0")/.." || exit 2
PYTHON=${PYTHON:-$(command -v python || command -v python3)}
exec "$PYTHON" bench/gpu_check.py "$@"
