#!/usr/bin/env bash
# Tiny PPO run on CPU (gloo): no downloads, a few minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
NPROC=${NPROC:-4}
exec python3 -m torch.distributed.run --standalone --nproc-per-node "$NPROC" train_ppo.py "$@"
