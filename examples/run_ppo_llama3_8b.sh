#!/usr/bin/env bash
# PPO of llama3_8b from HF checkpoints on one 8-GPU node: see examples/run_ppo_hf.sh (SFT_DIR, RM_DIR, DATA, OUT).
#   bash examples/run_ppo_llama3_8b.sh --dry-run      (validate + per-device memory estimate, no GPUs)
MODEL=llama3_8b exec bash "$(dirname "$0")/run_ppo_hf.sh" "$@"
