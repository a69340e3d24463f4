#!/usr/bin/env bash
# GRPO of Qwen3-30B-A3B (mixture of experts: 48 layers, 128 experts, top-8, 3.3B of 30.5B parameters
# active) on math prompts with a verifiable reward, 4096 tokens per sequence, 2 nodes x 8 GPUs (80 GB).
# The experts are split over E=8 ranks of a node (--expert-model-parallel-size); attention and the
# embeddings are data-parallel; the actor generates at its training layout. The plan search
# (--plan auto, or search_plan.py with these flags) trains the actor at (P,D,T) = (2,8,1) with E=2
# and generates at this layout, the reference at (2,8,1) with E=8: 0.17 % faster by its estimate
# (69.22 s against 69.34 s per iteration), at 77.4 GiB of 80 on the worst rank against 66.6 GiB
# here (docs/benchmarks.md, "Mixture of experts").
#
# Weights: the actor and the reference start from Qwen3-30B-A3B, SFT_DIR (no critic, no reward
# model). CKPT_FORMAT=hf (default): an HF directory; CKPT_FORMAT=megatron: a Megatron-LM checkpoint
# (torch_dist, read at any (P, D, T, E)), with TOKENIZER naming the HF tokenizer directory (default
# SFT_DIR).
#
# One torchrun per node. Preemptible, requeued Slurm job: examples/slurm/grpo_qwen3_30b_a3b.sbatch.
# Or directly under Slurm (2 nodes, 1 task per node):
#   srun --nodes 2 --ntasks-per-node 1 bash examples/run_grpo_qwen3_30b_a3b.sh
# the first node of the allocation is the rendezvous and each node's rank is $SLURM_NODEID.
# Without Slurm: NNODES=2 NODE_RANK=0|1 MASTER_ADDR=<first node> bash examples/run_grpo_qwen3_30b_a3b.sh
# Any flag can be overridden at the end of the command line ("$@" comes last), e.g. --dry-run to
# validate every flag and print the layouts and the per-device memory estimate on any machine:
#   bash examples/run_grpo_qwen3_30b_a3b.sh --dry-run
set -euo pipefail
cd "$(dirname "$0")/.."

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-${SLURM_NNODES:-2}}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
if [[ -z "${MASTER_ADDR:-}" && -n "${SLURM_JOB_NODELIST:-}" ]]; then
    MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
fi
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
SFT_DIR=${SFT_DIR:-/checkpoints/Qwen3-30B-A3B}   # actor and reference
CKPT_FORMAT=${CKPT_FORMAT:-hf}                   # hf or megatron
TOKENIZER=${TOKENIZER:-$SFT_DIR}
DATA=${DATA:-/data/math_train.jsonl}
OUT=${OUT:-/checkpoints/grpo-qwen3-30b-a3b}

DISTRIBUTED_ARGS=(
    --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK"
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
)
MODEL_ARGS=(   # Qwen3-30B-A3B (its config.json or Megatron-LM args set the same shape when read)
    --num-layers 48 --hidden-size 2048 --ffn-hidden-size 6144 --num-attention-heads 32
    --group-query-attention --num-query-groups 4 --kv-channels 128 --qk-layernorm
    --seq-length 4096 --max-position-embeddings 40960 --rotary-base 1000000
    --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --position-embedding-type rope
    --untie-embeddings-and-output-weights --disable-bias-linear --make-vocab-size-divisible-by 128
    --bf16
)
MOE_ARGS=(     # 128 experts of 768, top-8 renormalised (norm_topk_prob), aux loss as the checkpoint's
    --num-experts 128 --moe-ffn-hidden-size 768 --moe-router-topk 8
    --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 0.001
    --moe-token-dispatcher-type alltoall
)
DATA_ARGS=(
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER"
    --vocab-size 151936                      # only used when the tokenizer files are absent, as in --dry-run
    --prompt-data "$DATA" --prompt-key prompt --apply-chat-template --max-prompt-length 512
)
case "$CKPT_FORMAT" in   # the weights of the actor and reference
hf) DATA_ARGS+=(--hf-actor-path "$SFT_DIR") ;;
megatron) DATA_ARGS+=(--pretrained-checkpoint "$SFT_DIR") ;;
*) echo "CKPT_FORMAT=$CKPT_FORMAT: hf or megatron" >&2; exit 2 ;;
esac
PARALLEL_ARGS=(  # actor and reference: (P, D, T) = (1, 16, 1), experts over E = 8 ranks of a node
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
    --expert-model-parallel-size 8 --expert-tensor-parallel-size 1
    --use-distributed-optimizer --ranks-per-node "$GPUS_PER_NODE"
)
TRAIN_ARGS=(
    --micro-batch-size 1 --global-batch-size 128 --train-iters 300
    --lr 1e-6 --min-lr 1e-7 --lr-decay-style cosine --lr-warmup-iters 10
    --weight-decay 0.0 --clip-grad 1.0 --seed 1234
)
GRPO_ARGS=(
    --advantage-estimator grpo --n-samples-per-prompt 8 --rollout-batch-size 32
    --max-new-tokens 3584 --temperature 1.0 --top-p 1.0
    --kl-coef 0 --use-kl-loss --kl-loss-coef 0.001 --kl-loss-type low_var_kl
    --clip-eps-low 0.2 --clip-eps-high 0.28 --loss-agg-mode token-mean --ppo-epochs 1
    --overlong-buffer-len 512 --overlong-penalty-factor 1.0
)
MEMORY_ARGS=(  # 4k-token sequences on 16x80 GB: docs/ppo.md "Memory levers"
    --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
    --rl-offload-optimizer-during-inference
    --inference-dynamic-batching-buffer-size-gb 8    # KV cache per GPU: sequences live at once
)
REWARD_ARGS=(
    --reward-fn puzzle.reward_functions.builtin:math_answer
    --reward-workers 4 --reward-timeout 10 --on-bad-reward default --bad-reward-value 0
)
LOG_ARGS=(--log-interval 1 --log-dir "$OUT/logs")

ALL_ARGS=("${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${DATA_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAIN_ARGS[@]}"
          "${GRPO_ARGS[@]}" "${REWARD_ARGS[@]}" "${LOG_ARGS[@]}" "${MEMORY_ARGS[@]}" "$@")
if [[ " $* " == *" --dry-run "* ]]; then   # validate + memory estimate on any machine, no GPUs needed
    exec python3 train_ppo.py --world-size $((GPUS_PER_NODE * NNODES)) "${ALL_ARGS[@]}"
fi
# torchrun once train_ppo.py's checks passed in this process; bad input: one error line, exit 2
exec python3 -m puzzle.tools.launch "${DISTRIBUTED_ARGS[@]}" train_ppo.py "${ALL_ARGS[@]}"
