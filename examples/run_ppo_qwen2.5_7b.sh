#!/usr/bin/env bash
# PPO of qwen2.5_7b on one 8-GPU node: see examples/run_ppo_hf.sh. Weights: actor and reference from SFT_DIR,
# reward model RM_DIR, critic CRITIC_DIR (default RM_DIR); HF directories, or Megatron-LM checkpoints
# with CKPT_FORMAT=megatron (TOKENIZER: the HF tokenizer directory). Also DATA, OUT.
#   bash examples/run_ppo_qwen2.5_7b.sh --dry-run      (validate + per-device memory estimate, no GPUs)
MODEL=qwen2.5_7b exec bash "$(dirname "$0")/run_ppo_hf.sh" "$@"
