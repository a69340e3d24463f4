#!/usr/bin/env bash
# Tiny PPO run on CPU (gloo): tiny LLaMA-architecture models, the bundled prompt set, a built-in
# learnable reward, 4 ranks with the actor at (P,D,T)=(2,1,2). No downloads; a few minutes on 2 cores.
# Weights: random initialisation for every role (--init-random; no checkpoint to download).
#   bash examples/run_ppo_tiny.sh --log-dir runs/tiny        (any flag below can be overridden)
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

DISTRIBUTED_ARGS=(--standalone --nproc-per-node "${NPROC:-4}")
MODEL_ARGS=(
    --num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4
    --group-query-attention --num-query-groups 2
    --seq-length 64 --max-position-embeddings 64
    --normalization RMSNorm --swiglu --position-embedding-type rope
    --untie-embeddings-and-output-weights --disable-bias-linear
    --tokenizer-type ByteLevelTokenizer
    --init-random   # no checkpoint: every model starts from random weights (--seed)
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2     # actor and reference
    --critic-tensor-model-parallel-size 2 --critic-pipeline-model-parallel-size 1
)
TRAIN_ARGS=(
    --micro-batch-size 2 --global-batch-size 16 --train-iters 24
    --lr 2e-3 --critic-lr 2e-3 --clip-grad 1.0 --seed 1234
)
PPO_ARGS=(
    --rollout-batch-size 16 --ppo-epochs 2 --max-new-tokens 16 --temperature 1.0
    --kl-coef 0.01 --gamma 1.0 --lam 0.95 --clip-eps 0.2 --value-clip-eps 0.2
    --reward-fn puzzle.reward_functions.builtin:lowercase_fraction
)
LOG_ARGS=(--log-interval 1)

# torchrun once train_ppo.py's checks passed in this process; bad input: one error line, exit 2
exec python3 -m puzzle.tools.launch "${DISTRIBUTED_ARGS[@]}" train_ppo.py \
    "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAIN_ARGS[@]}" "${PPO_ARGS[@]}" "${LOG_ARGS[@]}" "$@"
