#!/usr/bin/env bash
# PPO of a LLaMA-2-7B actor with a 7B critic and reward model on one node of 8 GPUs.
# Weights (said per role in the first lines of the run and of --dry-run):
#   actor, reference  the SFT model            SFT_DIR
#   critic            the reward model: its trunk and its score head as the initial value head
#                     (CRITIC_DIR, default RM_DIR); CRITIC_DIR=$SFT_DIR starts it from the SFT model
#                     with a new value head instead
#   reward            the reward model          RM_DIR (unless REWARD_FN is set)
# CKPT_FORMAT=hf (default): these are HF directories (config.json + safetensors; the reward model a
# *ForSequenceClassification checkpoint, e.g. made by python -m puzzle.tools.make_value_model).
# CKPT_FORMAT=megatron: they are Megatron-LM checkpoints (torch_dist, as pretrain_gpt.py saves them),
# read at any layout; TOKENIZER then names the HF tokenizer directory (default SFT_DIR).
# Multi-node: launch with examples/slurm/ppo_7b.sbatch. Any flag can be overridden at the end of the
# command line ("$@" comes last), e.g. --dry-run. Switches that a later flag cannot undo are
# environment variables: BF16=0 (fp32), DIST_OPT=0 (the plain megatron optimizer),
# REWARD_FN=module:function (a Python reward instead of the reward model RM_DIR).
set -euo pipefail
cd "$(dirname "$0")/.."

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
SFT_DIR=${SFT_DIR:-/checkpoints/llama2-7b-sft-hf}     # actor and reference
RM_DIR=${RM_DIR:-/checkpoints/llama2-7b-rm-hf}         # reward model
CRITIC_DIR=${CRITIC_DIR:-$RM_DIR}                      # critic (a reward model or an LM)
CKPT_FORMAT=${CKPT_FORMAT:-hf}                         # hf or megatron
TOKENIZER=${TOKENIZER:-$SFT_DIR}
DATA=${DATA:-/data/prompts.jsonl}
OUT=${OUT:-/checkpoints/ppo-7b}
BF16=${BF16:-1}
DIST_OPT=${DIST_OPT:-1}
REWARD_FN=${REWARD_FN:-}

DISTRIBUTED_ARGS=(
    --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK"
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
)
MODEL_ARGS=(   # LLaMA-2-7B
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32
    --seq-length 2048 --max-position-embeddings 4096
    --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --position-embedding-type rope
    --untie-embeddings-and-output-weights --disable-bias-linear --make-vocab-size-divisible-by 128
)
if [[ $BF16 == 1 ]]; then MODEL_ARGS+=(--bf16); fi
DATA_ARGS=(
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER"
    # the model's vocabulary rows (LLaMA-2: 32000, as many as its tokenizer has ids). Fewer rows than
    # the tokenizer's ids is refused at the start; rows beyond them are never sampled nor scored.
    # Without the tokenizer files (--dry-run on a laptop) it also stands in for the tokenizer's size.
    --vocab-size 32000
    --prompt-data "$DATA" --prompt-key prompt
)
case "$CKPT_FORMAT" in   # the weights of the actor and reference, and of the critic
hf) DATA_ARGS+=(--hf-actor-path "$SFT_DIR" --hf-critic-path "$CRITIC_DIR"); RM_FLAG=--hf-reward-path ;;
megatron) DATA_ARGS+=(--pretrained-checkpoint "$SFT_DIR" --critic-pretrained-checkpoint "$CRITIC_DIR")
          RM_FLAG=--reward-pretrained-checkpoint ;;
*) echo "CKPT_FORMAT=$CKPT_FORMAT: hf or megatron" >&2; exit 2 ;;
esac
PARALLEL_ARGS=(
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2       # actor training layout
    --actor-gen-tensor-model-parallel-size 4 --actor-gen-pipeline-model-parallel-size 1
    --critic-tensor-model-parallel-size 2 --critic-pipeline-model-parallel-size 2
    --switch-segments 8 --ranks-per-node "$GPUS_PER_NODE"
)
if [[ $DIST_OPT == 1 ]]; then PARALLEL_ARGS+=(--use-distributed-optimizer); fi
TRAIN_ARGS=(
    --micro-batch-size 4 --global-batch-size 64 --train-iters 500
    --lr 1e-6 --critic-lr 5e-6 --min-lr 1e-7 --lr-decay-style cosine --lr-warmup-iters 10
    --weight-decay 0.0 --clip-grad 1.0 --seed 1234
)
PPO_ARGS=(
    --rollout-batch-size 128 --ppo-epochs 1 --max-new-tokens 512 --temperature 1.0 --top-p 1.0
    --kl-coef 0.05 --kl-target 6.0 --kl-horizon 10000 --gamma 1.0 --lam 0.95
    --clip-eps 0.2 --value-clip-eps 0.2
)
if [[ -n $REWARD_FN ]]; then PPO_ARGS+=(--reward-fn "$REWARD_FN"); else PPO_ARGS+=("$RM_FLAG" "$RM_DIR"); fi
# memory levers: long responses (4k-8k tokens) fit 8x80 GB (docs/ppo.md "Memory levers")
PPO_ARGS+=(--recompute-granularity full --recompute-method uniform --recompute-num-layers 1
           --rl-offload-optimizer-during-inference --inference-dynamic-batching-buffer-size-gb 32)
LOG_ARGS=(--log-interval 1 --log-dir "$OUT/logs")

ALL_ARGS=("${MODEL_ARGS[@]}" "${DATA_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${PPO_ARGS[@]}" "${LOG_ARGS[@]}" "$@")
if [[ " $* " == *" --dry-run "* ]]; then   # validate + memory estimate on any machine, no GPUs needed
    exec python3 train_ppo.py --world-size $((GPUS_PER_NODE * NNODES)) "${ALL_ARGS[@]}"
fi
# torchrun once train_ppo.py's checks passed in this process; bad input: one error line, exit 2
exec python3 -m puzzle.tools.launch "${DISTRIBUTED_ARGS[@]}" train_ppo.py \
    "${MODEL_ARGS[@]}" "${DATA_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAIN_ARGS[@]}" \
    "${PPO_ARGS[@]}" "${LOG_ARGS[@]}" "$@"
