#!/usr/bin/env bash
# The test suite: pure unit tests (seconds), distributed gloo worlds, end-to-end tiny PPO runs.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
exec python3 -m pytest -q -ra --timeout 1200 tests "$@"
