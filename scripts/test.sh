#!/usr/bin/env bash
# The test suite: pure unit tests (seconds), distributed gloo worlds, end-to-end tiny PPO runs.
# The shared worlds and the learning-curve runs start in the background (SCHED_IDLE) once the
# tests are collected, and the tests reading them run last (tests/conftest.py); at the end pytest
# lists the 15 slowest tests. A quicker pass without the two learning-curve runs:
#   bash scripts/test.sh -m "not learning"
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
exec python3 -m pytest -q -ra --timeout 1200 --durations=15 tests "$@"
