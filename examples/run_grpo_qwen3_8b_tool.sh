#!/usr/bin/env bash
# GRPO of Qwen3-8B as a tool-calling agent: multi-turn samples where the model calls a calculator
# (--env calculator: the whitelist math parser, never eval) in Qwen's format and answers math
# prompts with a verifiable reward (1.0 for a final answer equal to the record's answer), 1 node x
# 8 GPUs (80 GB).
#
# A sample is up to 4 turns in one sequence (--max-turns 4): the model's turn ends at </tool_call>
# (Qwen2.5/Qwen3's tool-call end, read from the tokenizer's chat template; a template without a
# tool format is refused at start, naming it), the calculator's answer is inserted as the family's
# tool response (<|im_end|>, a user turn holding <tool_response>...</tool_response>, the assistant's
# next turn), capped at 64 tokens, and the model continues. The observation tokens are in the
# sequence but get no loss, no KL and no advantage. --max-new-tokens bounds the whole response,
# observations included. Metrics: env_turns_per_sample, env_tool_calls_per_sample,
# env_observation_tokens_per_sample, env_step_errors/timeouts; --log-samples shows the turns.
#
# Multi-turn generation runs at P=1 (the actor generates at (1,8,1): the switch reshards from its
# training layout T=2); the environment steps run in 4 reward workers per rank, 10 s each, while
# the other rows keep decoding (--env-step-overlap-calls).
# Data: JSONL records whose "prompt" is a message list (a system message that presents the tool
# {"name": "calculator", "arguments": {"expression": "..."}} in <tool_call></tool_call> tags, then
# the question) and an "answer".
#
# Weights: the actor and the reference start from Qwen3-8B, SFT_DIR (HF directory).
#   bash examples/run_grpo_qwen3_8b_tool.sh --dry-run   # every flag checked, layouts and memory, any machine
set -euo pipefail
cd "$(dirname "$0")/.."

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
SFT_DIR=${SFT_DIR:-/checkpoints/Qwen3-8B}   # actor and reference (HF directory, with its tokenizer)
DATA=${DATA:-/data/math_tool_train.jsonl}
OUT=${OUT:-/checkpoints/grpo-qwen3-8b-tool}

DISTRIBUTED_ARGS=(
    --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK"
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
)
MODEL_ARGS=(   # Qwen3-8B (its config.json sets the same shape when read)
    --num-layers 36 --hidden-size 4096 --ffn-hidden-size 12288 --num-attention-heads 32
    --group-query-attention --num-query-groups 8 --kv-channels 128 --qk-layernorm
    --seq-length 4096 --max-position-embeddings 40960 --rotary-base 1000000
    --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --position-embedding-type rope
    --untie-embeddings-and-output-weights --disable-bias-linear --make-vocab-size-divisible-by 128
    --bf16
)
DATA_ARGS=(
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$SFT_DIR"
    --vocab-size 151936                      # only used when the tokenizer files are absent (--dry-run)
    --prompt-data "$DATA" --prompt-key prompt --apply-chat-template --max-prompt-length 1024
    --hf-actor-path "$SFT_DIR"
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1       # actor training layout
    --actor-gen-tensor-model-parallel-size 1 --actor-gen-pipeline-model-parallel-size 1  # multi-turn: P=1
    --use-distributed-optimizer --ranks-per-node "$GPUS_PER_NODE"
)
TRAIN_ARGS=(
    --micro-batch-size 2 --global-batch-size 128 --train-iters 200
    --lr 1e-6 --min-lr 1e-7 --lr-decay-style cosine --lr-warmup-iters 10
    --weight-decay 0.0 --clip-grad 1.0 --seed 1234
)
GRPO_ARGS=(
    --advantage-estimator grpo --n-samples-per-prompt 8 --rollout-batch-size 64
    --max-new-tokens 3072 --temperature 1.0 --top-p 1.0
    --kl-coef 0 --use-kl-loss --kl-loss-coef 0.001 --kl-loss-type low_var_kl
    --clip-eps-low 0.2 --clip-eps-high 0.28 --loss-agg-mode token-mean --ppo-epochs 1
)
ENV_ARGS=(
    --env calculator --max-turns 4 --max-observation-tokens 64
    --reward-workers 4 --reward-timeout 10 --on-bad-reward default --bad-reward-value 0
)
MEMORY_ARGS=(--recompute-granularity full --recompute-method uniform --recompute-num-layers 1
             --rl-offload-optimizer-during-inference)
LOG_ARGS=(--log-interval 1 --log-samples 4 --log-dir "$OUT/logs" --save "$OUT" --save-interval 50 --load "$OUT")

ALL_ARGS=("${MODEL_ARGS[@]}" "${DATA_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${GRPO_ARGS[@]}"
          "${ENV_ARGS[@]}" "${LOG_ARGS[@]}" "${MEMORY_ARGS[@]}" "$@")
if [[ " $* " == *" --dry-run "* ]]; then   # validate + memory estimate on any machine, no GPUs needed
    exec python3 train_ppo.py --world-size $((GPUS_PER_NODE * NNODES)) "${ALL_ARGS[@]}"
fi
exec python3 -m puzzle.tools.launch "${DISTRIBUTED_ARGS[@]}" train_ppo.py "${ALL_ARGS[@]}"
