#!/usr/bin/env bash
# GRPO of a Llama-3.1-8B(-Instruct) actor on math prompts with a verifiable reward (no critic, no
# reward model; KL to the reference as a loss term), one node of 8 GPUs. The prompt file is JSONL
# with the question under "prompt" and the ground truth under "answer" (docs/grpo.md), e.g. GSM8K
# or MATH converted once. Any flag can be overridden at the end of the command line ("$@" comes
# last), e.g. --dry-run to validate every flag and print the memory estimate on any machine.
# Note: Llama-3.1 checkpoints use llama3 RoPE scaling; use a checkpoint and flags that match the
# model the run builds (--rotary-base 500000 below, no scaling).
# Weights: the actor and the reference start from the SFT/instruct model SFT_DIR (no critic, no
# reward model). CKPT_FORMAT=hf (default): an HF directory; CKPT_FORMAT=megatron: a Megatron-LM
# checkpoint (torch_dist, read at any layout), with TOKENIZER naming the HF tokenizer directory
# (default SFT_DIR). --load resumes the run from OUT once it has saved there.
set -euo pipefail
cd "$(dirname "$0")/.."

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
SFT_DIR=${SFT_DIR:-/checkpoints/llama3.1-8b-instruct-hf}   # actor and reference
CKPT_FORMAT=${CKPT_FORMAT:-hf}                              # hf or megatron
TOKENIZER=${TOKENIZER:-$SFT_DIR}
DATA=${DATA:-/data/math_train.jsonl}
OUT=${OUT:-/checkpoints/grpo-8b}

DISTRIBUTED_ARGS=(
    --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK"
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
)
MODEL_ARGS=(   # Llama-3.1-8B
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
    --group-query-attention --num-query-groups 8
    --seq-length 2048 --max-position-embeddings 8192 --rotary-base 500000
    --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --position-embedding-type rope
    --untie-embeddings-and-output-weights --disable-bias-linear --make-vocab-size-divisible-by 128
    --bf16
)
DATA_ARGS=(
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER"
    --vocab-size 128256                      # only used when the tokenizer files are absent (--dry-run)
    --prompt-data "$DATA" --prompt-key prompt --apply-chat-template --max-prompt-length 512
)
case "$CKPT_FORMAT" in   # the weights of the actor and reference
hf) DATA_ARGS+=(--hf-actor-path "$SFT_DIR") ;;
megatron) DATA_ARGS+=(--pretrained-checkpoint "$SFT_DIR") ;;
*) echo "CKPT_FORMAT=$CKPT_FORMAT: hf or megatron" >&2; exit 2 ;;
esac
PARALLEL_ARGS=(
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1       # actor training layout
    --actor-gen-tensor-model-parallel-size 2 --actor-gen-pipeline-model-parallel-size 1
    --use-distributed-optimizer --ranks-per-node "$GPUS_PER_NODE"
)
TRAIN_ARGS=(
    --micro-batch-size 2 --global-batch-size 128 --train-iters 300
    --lr 1e-6 --min-lr 1e-7 --lr-decay-style cosine --lr-warmup-iters 10
    --weight-decay 0.0 --clip-grad 1.0 --seed 1234
)
GRPO_ARGS=(
    --advantage-estimator grpo --n-samples-per-prompt 8 --rollout-batch-size 64
    --max-new-tokens 1024 --temperature 1.0 --top-p 1.0
    --kl-coef 0 --use-kl-loss --kl-loss-coef 0.001 --kl-loss-type low_var_kl
    --clip-eps-low 0.2 --clip-eps-high 0.28 --loss-agg-mode token-mean --ppo-epochs 1
    --overlong-buffer-len 256 --overlong-penalty-factor 1.0
)
MEMORY_ARGS=(  # long responses (8k-16k tokens) fit 8x80 GB: docs/ppo.md "Memory levers"
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
    --rl-offload-optimizer-during-inference
    --inference-dynamic-batching-buffer-size-gb 16   # KV cache per GPU: sequences live at once
)
REWARD_ARGS=(
    --reward-fn puzzle.reward_functions.builtin:math_answer
    --reward-workers 4 --reward-timeout 10 --on-bad-reward default --bad-reward-value 0
)
LOG_ARGS=(--log-interval 1 --log-dir "$OUT/logs" --save "$OUT" --save-interval 50 --load "$OUT")

ALL_ARGS=("${MODEL_ARGS[@]}" "${DATA_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${GRPO_ARGS[@]}"
          "${REWARD_ARGS[@]}" "${LOG_ARGS[@]}" "${MEMORY_ARGS[@]}" "$@")
if [[ " $* " == *" --dry-run "* ]]; then   # validate + memory estimate on any machine, no GPUs needed
    exec python3 train_ppo.py --world-size $((GPUS_PER_NODE * NNODES)) "${ALL_ARGS[@]}"
fi
# torchrun once train_ppo.py's checks passed in this process; bad input: one error line, exit 2
exec python3 -m puzzle.tools.launch "${DISTRIBUTED_ARGS[@]}" train_ppo.py "${ALL_ARGS[@]}"
