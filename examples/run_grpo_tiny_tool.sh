#!/usr/bin/env bash
# Tiny tool-calling GRPO run on CPU (gloo): a 2-layer byte-level actor, from random weights, asked
# the last digit of a product of two two-digit numbers
# (puzzle/data/bundled/tiny_tool_last_digits.jsonl, each digit 0..9 equally often), which alone it
# learns only slowly (a table of the operands' last digits: solved ~0.4 in 150 iterations with
# --max-turns 1 --max-new-tokens 1). Each prompt asks it and opens a tool call with the product
# ("85*91%10=[85*91"): the model closes it with "]" (a turn ends there), the environment's
# observation "=7735" is inserted into the sample, and the model answers in its second turn
# (--max-turns 2) with one byte, the last one of the budget (--max-new-tokens 7: "]", five
# observation bytes, the answer). Environment: --env calculator_tiny (ByteCalculator,
# puzzle/reward_functions/environments.py): 1.0 for a right answer; after a call that evaluated, 0.1
# plus 0.1 for a digit. Observation tokens get no loss (loss mask 0). No critic, no reference
# (--kl-coef 0), 16 samples per prompt, 4 optimizer steps per rollout (--global-batch-size 128), an
# entropy bonus that keeps the policy exploring after it learned to call. Metrics: reward_mean,
# solved_fraction, env_tool_calls_per_sample, env_turns_per_sample,
# env_observation_tokens_per_sample, env_step_errors/timeouts; --log-samples N shows each sample's
# turns. In 150 iterations (3 minutes) tool calls per sample go 0.014 -> 1.00 (by iteration 20),
# solved_fraction 0.000 -> 0.83 at 80 (best 0.93, 0.72 over the last 10), reward 0.0002 -> 0.83:
# docs/grpo.md, "Examples".
#   bash examples/run_grpo_tiny_tool.sh --log-dir runs/grpo-tiny-tool   (any flag below can be overridden)
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

DISTRIBUTED_ARGS=(--standalone --nproc-per-node "${NPROC:-2}")
MODEL_ARGS=(
    --num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4
    --seq-length 24 --max-position-embeddings 24
    --normalization RMSNorm --swiglu --position-embedding-type rope
    --untie-embeddings-and-output-weights --disable-bias-linear
    --tokenizer-type ByteLevelTokenizer
    --init-random   # no checkpoint: every model starts from random weights (--seed)
)
PARALLEL_ARGS=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1)
TRAIN_ARGS=(--micro-batch-size 32 --global-batch-size 128 --train-iters 150 --lr 3e-3 --clip-grad 1.0 --seed 1234)
GRPO_ARGS=(
    --advantage-estimator grpo --n-samples-per-prompt 16 --rollout-batch-size 32
    --max-new-tokens 7 --temperature 1.0 --kl-coef 0 --clip-eps 0.2 --entropy-coef 0.05
)
ENV_ARGS=(--env calculator_tiny --max-turns 2 --max-observation-tokens 16)
DATA_ARGS=(--prompt-data puzzle/data/bundled/tiny_tool_last_digits.jsonl)  # python -m puzzle.data.tool_last_digits
LOG_ARGS=(--log-interval 1)

# torchrun once train_ppo.py's checks passed in this process; bad input: one error line, exit 2
exec python3 -m puzzle.tools.launch "${DISTRIBUTED_ARGS[@]}" train_ppo.py \
    "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${GRPO_ARGS[@]}" "${ENV_ARGS[@]}" \
    "${DATA_ARGS[@]}" "${LOG_ARGS[@]}" "$@"
