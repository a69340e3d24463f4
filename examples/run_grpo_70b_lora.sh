#!/usr/bin/env bash
# GRPO of a Llama-3.1-70B(-Instruct) actor with LoRA adapters on math prompts with a verifiable
# reward, two nodes of 8 GPUs (80 GB). The base stays frozen (bf16 weights only: no gradients, no
# optimizer state); rank-64 adapters on every linear of every layer train (Megatron-Bridge's
# names: --lora-dim, --lora-alpha, --lora-target-modules). The KL term's reference is the base
# itself -- the actor with its adapters off, scored in the actor's slot -- so no reference model is
# built. Any flag can be overridden at the end of the command line ("$@" comes last), e.g.
#   bash examples/run_grpo_70b_lora.sh --dry-run        (every flag checked, memory per GPU, any machine)
# Weights: the base from the instruct model BASE_DIR (CKPT_FORMAT=hf: an HF directory;
# CKPT_FORMAT=megatron: a Megatron-LM checkpoint, TOKENIZER naming the HF tokenizer directory).
# Checkpoints under OUT hold the adapters and their optimizer state (megabytes) and the base's
# fingerprint; --load resumes them, refusing another base. Export the adapters for PEFT with
#   python -m puzzle.tools.export_hf --load OUT --save adapter-dir
# Note: Llama-3.1 checkpoints use llama3 RoPE scaling; use a checkpoint and flags that match the
# model the run builds (--rotary-base 500000 below, no scaling).
set -euo pipefail
cd "$(dirname "$0")/.."

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-2}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
BASE_DIR=${BASE_DIR:-/checkpoints/llama3.1-70b-instruct-hf}   # the frozen base (and the reference)
CKPT_FORMAT=${CKPT_FORMAT:-hf}                                 # hf or megatron
TOKENIZER=${TOKENIZER:-$BASE_DIR}
DATA=${DATA:-/data/math_train.jsonl}
OUT=${OUT:-/checkpoints/grpo-70b-lora}

DISTRIBUTED_ARGS=(
    --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK"
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
)
MODEL_ARGS=(   # Llama-3.1-70B
    --num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64
    --group-query-attention --num-query-groups 8
    --seq-length 2048 --max-position-embeddings 8192 --rotary-base 500000
    --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --position-embedding-type rope
    --untie-embeddings-and-output-weights --disable-bias-linear --make-vocab-size-divisible-by 128
    --bf16
)
LORA_ARGS=(--lora-dim 64 --lora-alpha 128 --lora-dropout 0.0
           --lora-target-modules linear_qkv,linear_proj,linear_fc1,linear_fc2)
DATA_ARGS=(
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER"
    --vocab-size 128256                      # only used when the tokenizer files are absent (--dry-run)
    --prompt-data "$DATA" --prompt-key prompt --apply-chat-template --max-prompt-length 512
)
case "$CKPT_FORMAT" in   # the base's weights
hf) DATA_ARGS+=(--hf-actor-path "$BASE_DIR") ;;
megatron) DATA_ARGS+=(--pretrained-checkpoint "$BASE_DIR") ;;
*) echo "CKPT_FORMAT=$CKPT_FORMAT: hf or megatron" >&2; exit 2 ;;
esac
PARALLEL_ARGS=(   # 70B / 16 GPUs: T=8 within a node, P=2 across the two; generation in the same layout
    --tensor-model-parallel-size 8 --pipeline-model-parallel-size 2
    --use-distributed-optimizer --ranks-per-node "$GPUS_PER_NODE"
)
TRAIN_ARGS=(
    --micro-batch-size 1 --global-batch-size 64 --train-iters 200
    --lr 1e-5 --min-lr 1e-6 --lr-decay-style cosine --lr-warmup-iters 10   # adapters: a higher lr than full training
    --weight-decay 0.0 --clip-grad 1.0 --seed 1234
)
GRPO_ARGS=(
    --advantage-estimator grpo --n-samples-per-prompt 8 --rollout-batch-size 64
    --max-new-tokens 1024 --temperature 1.0 --top-p 1.0
    --kl-coef 0 --use-kl-loss --kl-loss-coef 0.001 --kl-loss-type low_var_kl   # reference: the base
    --clip-eps-low 0.2 --clip-eps-high 0.28 --loss-agg-mode token-mean --ppo-epochs 1
)
MEMORY_ARGS=(--recompute-granularity full --recompute-method uniform --recompute-num-layers 1)
REWARD_ARGS=(
    --reward-fn puzzle.reward_functions.builtin:math_answer
    --reward-workers 4 --reward-timeout 10 --on-bad-reward default --bad-reward-value 0
)
LOG_ARGS=(--log-interval 1 --log-dir "$OUT/logs" --save "$OUT" --save-interval 25 --load "$OUT")

ALL_ARGS=("${MODEL_ARGS[@]}" "${LORA_ARGS[@]}" "${DATA_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAIN_ARGS[@]}"
          "${GRPO_ARGS[@]}" "${REWARD_ARGS[@]}" "${LOG_ARGS[@]}" "${MEMORY_ARGS[@]}" "$@")
if [[ " $* " == *" --dry-run "* ]]; then   # validate + memory estimate on any machine, no GPUs needed
    exec python3 train_ppo.py --world-size $((GPUS_PER_NODE * NNODES)) "${ALL_ARGS[@]}"
fi
# torchrun once train_ppo.py's checks passed in this process; bad input: one error line, exit 2
exec python3 -m puzzle.tools.launch "${DISTRIBUTED_ARGS[@]}" train_ppo.py "${ALL_ARGS[@]}"
