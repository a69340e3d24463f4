#!/usr/bin/env bash
# PPO of qwen2.5_7b from HF checkpoints on one 8-GPU node: see examples/run_ppo_hf.sh (SFT_DIR, RM_DIR, DATA, OUT).
#   bash examples/run_ppo_qwen2.5_7b.sh --dry-run      (validate + per-device memory estimate, no GPUs)
MODEL=qwen2.5_7b exec bash "$(dirname "$0")/run_ppo_hf.sh" "$@"
