#!/usr/bin/env bash
# PPO from HF checkpoints of the families people align today, on one node of 8 GPUs:
#   MODEL=llama3_8b    Llama-3.1-8B-Instruct actor/ref, a Llama-3.1-8B reward model and critic
#   MODEL=qwen2.5_7b   Qwen2.5-7B-Instruct actor/ref, a Qwen2.5-7B reward model and critic
# (examples/run_ppo_llama3_8b.sh and examples/run_ppo_qwen2.5_7b.sh set MODEL.) The checkpoints'
# config.json set the shapes; the MODEL_ARGS below repeat them so that --dry-run validates and
# estimates memory without the files (a flag that disagrees with a present config.json is an
# error naming both values).
# Weights (said per role in the first lines of the run and of --dry-run): the actor and the
# reference start from SFT_DIR; the reward model is RM_DIR, a *ForSequenceClassification checkpoint
# (score head, num_labels=1) of the same family (python -m puzzle.tools.make_value_model makes one
# from an LM); the critic starts from CRITIC_DIR (default RM_DIR: the reward model's trunk and score
# head as its initial value head; CRITIC_DIR=$SFT_DIR: the SFT model with a new value head).
# CKPT_FORMAT=megatron: SFT_DIR, RM_DIR and CRITIC_DIR are Megatron-LM checkpoints (torch_dist)
# instead, TOKENIZER the HF tokenizer directory (default SFT_DIR). Stop ids come from TOKENIZER's
# generation_config.json (Llama-3: <|eot_id|>, <|eom_id|>, <|end_of_text|>; Qwen2.5: <|im_end|>,
# <|endoftext|>) and prompts get the family's chat template.
# Any flag can be overridden at the end of the command line ("$@" comes last), e.g. --dry-run.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:?set MODEL=llama3_8b or MODEL=qwen2.5_7b}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
DATA=${DATA:-/data/prompts.jsonl}
OUT=${OUT:-/checkpoints/ppo-$MODEL}
CKPT_FORMAT=${CKPT_FORMAT:-hf}                         # hf or megatron

case "$MODEL" in
llama3_8b)
    SFT_DIR=${SFT_DIR:-/checkpoints/Llama-3.1-8B-Instruct}   # actor and reference
    RM_DIR=${RM_DIR:-/checkpoints/Llama-3.1-8B-rm}           # reward model
    MODEL_ARGS=(   # Llama-3.1-8B: GQA 32/8, llama3 RoPE scaling, vocab 128256
        --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
        --group-query-attention --num-query-groups 8 --kv-channels 128
        --rotary-base 500000 --use-rope-scaling --rope-scaling-factor 8 --rope-low-freq-factor 1
        --rope-high-freq-factor 4 --rope-original-max-position-embeddings 8192
        --norm-epsilon 1e-5 --vocab-size 128256
    )
    PARALLEL_ARGS=(
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2       # actor training layout
        --actor-gen-tensor-model-parallel-size 4 --actor-gen-pipeline-model-parallel-size 1
        --critic-tensor-model-parallel-size 2 --critic-pipeline-model-parallel-size 2
    )
    ;;
qwen2.5_7b)
    SFT_DIR=${SFT_DIR:-/checkpoints/Qwen2.5-7B-Instruct}     # actor and reference
    RM_DIR=${RM_DIR:-/checkpoints/Qwen2.5-7B-rm}             # reward model
    MODEL_ARGS=(   # Qwen2.5-7B: GQA 28/4, q/k/v biases, vocab 152064
        --num-layers 28 --hidden-size 3584 --ffn-hidden-size 18944 --num-attention-heads 28
        --group-query-attention --num-query-groups 4 --add-qkv-bias
        --rotary-base 1000000 --norm-epsilon 1e-6 --vocab-size 152064
    )
    PARALLEL_ARGS=(
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
        --actor-gen-tensor-model-parallel-size 4 --actor-gen-pipeline-model-parallel-size 1
        --critic-tensor-model-parallel-size 2 --critic-pipeline-model-parallel-size 2
    )
    ;;
*)
    echo "unknown MODEL=$MODEL (llama3_8b or qwen2.5_7b)" >&2
    exit 2
    ;;
esac

DISTRIBUTED_ARGS=(
    --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK"
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
)
COMMON_MODEL_ARGS=(
    --seq-length 2048 --normalization RMSNorm --swiglu --position-embedding-type rope
    --untie-embeddings-and-output-weights --disable-bias-linear --make-vocab-size-divisible-by 128 --bf16
)
CRITIC_DIR=${CRITIC_DIR:-$RM_DIR}                      # critic (a reward model or an LM)
TOKENIZER=${TOKENIZER:-$SFT_DIR}
DATA_ARGS=(
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER"
    --prompt-data "$DATA" --prompt-key prompt --apply-chat-template
)
case "$CKPT_FORMAT" in   # the weights: actor and reference, critic, reward model
hf) DATA_ARGS+=(--hf-actor-path "$SFT_DIR" --hf-critic-path "$CRITIC_DIR" --hf-reward-path "$RM_DIR") ;;
megatron) DATA_ARGS+=(--pretrained-checkpoint "$SFT_DIR" --critic-pretrained-checkpoint "$CRITIC_DIR"
                      --reward-pretrained-checkpoint "$RM_DIR") ;;
*) echo "CKPT_FORMAT=$CKPT_FORMAT: hf or megatron" >&2; exit 2 ;;
esac
PARALLEL_ARGS+=(--use-distributed-optimizer --switch-segments 8 --ranks-per-node "$GPUS_PER_NODE")
TRAIN_ARGS=(
    --micro-batch-size 2 --global-batch-size 64 --train-iters 500
    --lr 1e-6 --critic-lr 5e-6 --min-lr 1e-7 --lr-decay-style cosine --lr-warmup-iters 10
    --weight-decay 0.0 --clip-grad 1.0 --seed 1234
)
PPO_ARGS=(
    --rollout-batch-size 128 --ppo-epochs 1 --max-new-tokens 512 --temperature 1.0 --top-p 1.0
    --generation-micro-batch-size 32
    --kl-coef 0.05 --kl-target 6.0 --kl-horizon 10000 --gamma 1.0 --lam 0.95
    --clip-eps 0.2 --value-clip-eps 0.2
)
LOG_ARGS=(--log-interval 1 --log-dir "$OUT/logs" --save "$OUT/ckpt" --save-interval 50)

ALL_ARGS=("${MODEL_ARGS[@]}" "${COMMON_MODEL_ARGS[@]}" "${DATA_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAIN_ARGS[@]}"
          "${PPO_ARGS[@]}" "${LOG_ARGS[@]}" "$@")
if [[ " $* " == *" --dry-run "* ]]; then   # validate + memory estimate on any machine, no GPUs needed
    exec python3 train_ppo.py --world-size $((GPUS_PER_NODE * NNODES)) "${ALL_ARGS[@]}"
fi
# torchrun once train_ppo.py's checks passed in this process; bad input: one error line, exit 2
exec python3 -m puzzle.tools.launch "${DISTRIBUTED_ARGS[@]}" train_ppo.py "${ALL_ARGS[@]}"
