#!/usr/bin/env bash
# The multi-rank paths on CUDA tensors with ONE GPU: 2-4 ranks share the device over gloo
# (--distributed-backend gloo; NCCL refuses two ranks on one GPU). Every run has a CPU twin with the
# same flags (CUDA hidden), and python -m puzzle.tools.compare_metrics checks each pair:
#   1. tiny PPO at (P,D,T) = (2,1,2), time-sharing (scoring and training), generation switched to
#      (1,4,1); saves a checkpoint halfway;
#   2. tiny PPO resumed from that checkpoint at (1,2,2), time-sharing, generation switched;
#   3. tiny GRPO at (2,1,2), time-sharing, switched, one iteration; 4. one more iteration resumed
#      at (1,2,2) from the GPU run's checkpoint, by both twins (see the note there);
#   5. python -m puzzle.tools.generate at T = 2 from the GPU's PPO checkpoint: the same greedy tokens
#      on the GPU (2 ranks sharing it) as on the CPU.
# Exits non-zero on any failure.
#   bash scripts/gpu_multirank.sh      (MULTI_DIR=runs/gpu_multirank, MULTI_ITERS=8)
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
OUT=${MULTI_DIR:-runs/gpu_multirank}
ITERS=${MULTI_ITERS:-8}
HALF=$((ITERS / 2))
mkdir -p "$OUT"
# fractions of tokens at a clip boundary: a last-bit difference between devices moves a whole token
CLIP_COUNTS=(--field-atol clip_frac=0.02 --field-atol value_clip_frac=0.02)
SHARED=(--distributed-backend gloo --score-placement time-sharing --train-placement time-sharing
        --actor-gen-tensor-model-parallel-size 1 --actor-gen-pipeline-model-parallel-size 1)
layout() {  # T P [critic]: the actor's and the reference's layout (and the critic's)
    echo --tensor-model-parallel-size "$1" --pipeline-model-parallel-size "$2"
    [ "${3:-}" = critic ] && echo --critic-tensor-model-parallel-size "$1" --critic-pipeline-model-parallel-size "$2"
    true
}

# NAME SCRIPT ARGS...: the run on the GPU and its CPU twin, at the same time; then the comparison
twin() {
    local name=$1 script=$2
    shift 2
    echo; echo "=== $name: $* ==="
    NPROC=4 bash "$script" "$@" --log-dir "$OUT/${name}_gpu" > "$OUT/${name}_gpu.log" 2>&1 &
    local gpu=$!
    CUDA_VISIBLE_DEVICES= NPROC=4 bash "$script" "${@//_gpu/_cpu}" --log-dir "$OUT/${name}_cpu" \
        > "$OUT/${name}_cpu.log" 2>&1 || { tail -30 "$OUT/${name}_cpu.log"; exit 1; }
    wait $gpu || { tail -30 "$OUT/${name}_gpu.log"; exit 1; }
    python3 -m puzzle.tools.compare_metrics "$OUT/${name}_cpu/metrics.jsonl" "$OUT/${name}_gpu/metrics.jsonl" \
        --rtol 1e-4 --atol 1e-6 "${CLIP_COUNTS[@]}"
}

python3 -c "import torch; print('device:', torch.cuda.get_device_name() if torch.cuda.is_available() else 'none (both runs on the CPU)')"
rm -rf "$OUT"/ckpt_* "$OUT/grpo_start"
# shellcheck disable=SC2046
twin ppo_212 examples/run_ppo_tiny.sh $(layout 2 2 critic) "${SHARED[@]}" --train-iters "$HALF" \
    --save "$OUT/ckpt_ppo_gpu" --save-interval "$HALF"
# shellcheck disable=SC2046
twin ppo_122_resumed examples/run_ppo_tiny.sh $(layout 2 1 critic) "${SHARED[@]}" --train-iters "$ITERS" \
    --load "$OUT/ckpt_ppo_gpu"
# GRPO's tiny run amplifies fp32 rounding: its group-centred advantages cancel in the gradients, and
# Adam scales what is left to a full step (CPU at (1,1,1) against CPU at (1,1,2): kl differs by 5 % at
# iteration 2). So each GRPO twin runs one iteration from the same weights: from the initialisation
# at (2,1,2), then from the GPU run's checkpoint resumed at (1,2,2) by both.
GRPO=(--eval-iters 0 --kl-coef 0.001)  # a reference model, so scoring time-shares two models
# shellcheck disable=SC2046
twin grpo_212 examples/run_grpo_tiny.sh $(layout 2 2) "${SHARED[@]}" "${GRPO[@]}" --train-iters 1 \
    --save "$OUT/ckpt_grpo_gpu" --save-interval 1
rm -rf "$OUT/grpo_start" && cp -r "$OUT/ckpt_grpo_gpu" "$OUT/grpo_start"
# shellcheck disable=SC2046
twin grpo_122_resumed examples/run_grpo_tiny.sh $(layout 2 1) "${SHARED[@]}" "${GRPO[@]}" --train-iters 2 \
    --load "$OUT/grpo_start"

echo; echo "=== generate at T = 2 from the GPU run's PPO checkpoint, on the GPU and on the CPU ==="
head -8 puzzle/data/bundled/tiny_arithmetic_eval.jsonl > "$OUT/prompts.jsonl"
for dev in gpu cpu; do
    hide=(); [ "$dev" = cpu ] && hide=(env CUDA_VISIBLE_DEVICES=)
    "${hide[@]}" python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m puzzle.tools.generate \
        --load "$OUT/ckpt_ppo_gpu" --tensor-model-parallel-size 2 --distributed-backend gloo \
        --tokenizer-type ByteLevelTokenizer --prompts "$OUT/prompts.jsonl" --output "$OUT/generated_$dev.jsonl" \
        --greedy --max-new-tokens 16 > "$OUT/generate_$dev.log" 2>&1 || { tail -30 "$OUT/generate_$dev.log"; exit 1; }
done
python3 - "$OUT/generated_gpu.jsonl" "$OUT/generated_cpu.jsonl" <<'PY'
import json, sys
gpu, cpu = ([json.loads(line)["tokens"] for line in open(p)] for p in sys.argv[1:3])
same = sum(a == b for a, b in zip(gpu, cpu))
print(f"generate T=2: {same} of {len(cpu)} greedy responses equal the CPU run's")
sys.exit(0 if same == len(cpu) and len(gpu) == len(cpu) else 1)
PY
echo; echo "gpu_multirank: all checks passed"
