#!/usr/bin/env bash
# Tiny GRPO with a LoRA actor on CPU (issue #39): rank-8 adapters on every linear of the 2-layer
# byte-level actor of run_grpo_tiny.sh learn the bundled one-digit sums on a frozen base.
# From random weights LoRA cannot learn them (the frozen output layer caps the digits' logits), so
# the base is made first, once: run_grpo_tiny.sh's full training for 40 iterations, saved and
# exported as a Megatron-LM checkpoint (BASE/megatron), which the LoRA run reads with
# --pretrained-checkpoint (its adapters start at zero B: iteration 0 is the base). The adapters
# train at --lr 5e-3 (alpha/dim = 4) for 60 iterations: held-out greedy accuracy 0.164 -> 0.182
# (iteration 40) -> 0.309 (60), the sampled solved fraction 0.167 (iterations 1-10) -> 0.196 (51-60),
# where the base alone (--lr 0, 30 iterations) stays at 0.164 and 0.164 -> 0.161. --lr 1e-2
# reached 0.236; 3e-2 did not learn (its first steps collapse the solve rate). Measured with NPROC=1.
#   bash examples/run_grpo_tiny_lora.sh --log-dir runs/grpo-tiny-lora    (any flag below can be overridden)
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=${BASE:-runs/grpo-tiny-base}

if [[ ! -f "$BASE/megatron/latest_checkpointed_iteration.txt" ]]; then
    bash examples/run_grpo_tiny.sh --train-iters 40 --eval-interval 40 --save "$BASE/run"
    python3 -m puzzle.tools.export_megatron --load "$BASE/run" --save "$BASE/megatron"
fi
exec bash examples/run_grpo_tiny.sh --pretrained-checkpoint "$BASE/megatron" \
    --lora-dim 8 --lora-alpha 32 --lr 5e-3 --train-iters 60 --eval-interval 20 "$@"
