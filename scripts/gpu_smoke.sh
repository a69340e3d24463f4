#!/usr/bin/env bash
# What to run first on a GPU box. Exits non-zero on any failure.
#   1. the tiny PPO run on one GPU in fp32; its metrics must match the same run on the CPU
#      (relative 1e-4);
#   1b. packed attention: one flash-attention varlen call per micro-batch against one SDPA call per
#      distinct length, bf16, outputs and gradients (python -m puzzle.bench.packed_attention);
#   2. a ~1.1B LLaMA-shaped actor, critic, reference and reward model (random init, no downloads)
#      for a few iterations in bf16 on one GPU, then its figures: per-stage seconds, generation
#      tokens/s against the decode bound, training MFU, peak memory per stage against the dry run;
#   3. with 2+ GPUs: the tiny run with TP/PP, time-sharing and the switch (NCCL), and its CPU twin;
#   4. on any GPU count: 4 ranks sharing one GPU over gloo (scripts/gpu_multirank.sh): PPO and GRPO
#      at (2,1,2) and (1,2,2), time-sharing, the switch, a checkpoint resumed at another layout,
#      generate at T = 2, each against its CPU twin;
#   5. MoE on one GPU: the tiny run with a MoE actor (fp32) against its CPU twin, then in bf16 with
#      the graphed static MoE decode step (generation-vs-scoring log-prob difference per iteration),
#      the graphed MoE decode step's time (python -m puzzle.bench.decode_step --num-experts 8), and
#      --moe-grouped-gemm against SequentialMLP experts (python -m puzzle.bench.moe_experts).
#   bash scripts/gpu_smoke.sh        (SMOKE_DIR=runs/gpu_smoke, LLAMA_ITERS=4, LLAMA_FLAGS="more flags")
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
OUT=${SMOKE_DIR:-runs/gpu_smoke}
mkdir -p "$OUT"
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "$NGPU" -lt 1 ]; then echo "error: gpu_smoke.sh needs a CUDA device (found none)" >&2; exit 1; fi
python3 - <<'PY'
import importlib.metadata as md, torch
print(f"gpu: {torch.cuda.get_device_name()} x{torch.cuda.device_count()}; torch {torch.__version__}; "
      f"megatron-core {md.version('megatron-core')}")
try:
    import transformer_engine  # noqa: F401
    print("transformer_engine: present")
except Exception as e:  # noqa: BLE001
    print(f"transformer_engine: absent ({type(e).__name__}); the local implementation is used")
PY

step() { echo; echo "=== $* ==="; }
# fractions of tokens at a clip boundary: a last-bit difference between devices moves a whole
# token (1/250 here), so these two get an absolute tolerance of a few tokens instead
CLIP_COUNTS="--field-atol clip_frac=0.02 --field-atol value_clip_frac=0.02"

# 1. tiny run, fp32, one GPU vs CPU
ONE_RANK=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
          --critic-tensor-model-parallel-size 1 --critic-pipeline-model-parallel-size 1
          --train-iters "${TINY_ITERS:-8}")
step "tiny PPO, fp32, 1 GPU"
NPROC=1 bash examples/run_ppo_tiny.sh "${ONE_RANK[@]}" --log-dir "$OUT/tiny_gpu" > "$OUT/tiny_gpu.log" 2>&1 \
    || { tail -40 "$OUT/tiny_gpu.log"; exit 1; }
tail -2 "$OUT/tiny_gpu.log"
step "tiny PPO, fp32, CPU (same flags)"
CUDA_VISIBLE_DEVICES= NPROC=1 bash examples/run_ppo_tiny.sh "${ONE_RANK[@]}" --log-dir "$OUT/tiny_cpu" \
    > "$OUT/tiny_cpu.log" 2>&1 || { tail -40 "$OUT/tiny_cpu.log"; exit 1; }
python3 -m puzzle.tools.compare_metrics "$OUT/tiny_cpu/metrics.jsonl" "$OUT/tiny_gpu/metrics.jsonl" \
    --rtol 1e-4 --atol 1e-6 $CLIP_COUNTS

# 1b. packed attention on the GPU: the one-call varlen path against the per-length calls
step "packed attention, bf16: flash varlen (one call) against SDPA per length"
python3 -m puzzle.bench.packed_attention | tee "$OUT/packed_attention.json"
python3 - "$OUT/packed_attention.json" <<'PY'
import json, sys
row = json.load(open(sys.argv[1]))
worst = max(row["max_abs_diff"].values())
assert worst < 0.05, f"flash varlen differs from the per-length SDPA calls by {worst} (bf16)"
PY

# 2. ~1.1B LLaMA (TinyLlama shape: 22 layers, hidden 2048, GQA 32/4), bf16, one GPU
LLAMA=(
    --num-layers 22 --hidden-size 2048 --ffn-hidden-size 5632 --num-attention-heads 32
    --group-query-attention --num-query-groups 4 --seq-length 1024 --max-position-embeddings 2048
    --normalization RMSNorm --swiglu --position-embedding-type rope
    --untie-embeddings-and-output-weights --disable-bias-linear --tokenizer-type ByteLevelTokenizer
    --bf16 --micro-batch-size 8 --global-batch-size 64 --train-iters "${LLAMA_ITERS:-4}"
    --lr 1e-6 --critic-lr 1e-6 --rollout-batch-size 64 --ppo-epochs 1
    --max-new-tokens "${LLAMA_NEW_TOKENS:-256}" --max-prompt-length 128
    --kl-coef 0.05 --reward-model random --init-random --cuda-graph-generation --compile-generation ${LLAMA_FLAGS:-}
)
step "~1.1B LLaMA actor/critic/ref/reward, bf16, 1 GPU"
torchrun --standalone --nproc-per-node 1 train_ppo.py "${LLAMA[@]}" --log-dir "$OUT/llama1b" \
    > "$OUT/llama1b.log" 2>&1 || { tail -40 "$OUT/llama1b.log"; exit 1; }
grep "iteration" "$OUT/llama1b.log" | tail -"${LLAMA_ITERS:-4}"
python3 -m puzzle.bench.gpu_report --metrics "$OUT/llama1b/metrics.jsonl" -- "${LLAMA[@]}" \
    | tee "$OUT/llama1b_report.json"

# 3. several GPUs: TP/PP layouts, time-sharing and the switch, against the CPU twin
if [ "$NGPU" -ge 2 ]; then
    N=$(( NGPU >= 4 ? 4 : 2 ))
    MULTI=(--train-iters "${TINY_ITERS:-8}" --tensor-model-parallel-size 2 --pipeline-model-parallel-size $((N / 2))
           --critic-tensor-model-parallel-size 2 --critic-pipeline-model-parallel-size $((N / 2))
           --score-placement time-sharing --train-placement time-sharing
           --actor-gen-tensor-model-parallel-size 1 --actor-gen-pipeline-model-parallel-size 1)
    step "tiny PPO, fp32, $N GPUs: TP/PP, time-sharing, switch"
    NPROC=$N bash examples/run_ppo_tiny.sh "${MULTI[@]}" --log-dir "$OUT/multi_gpu" > "$OUT/multi_gpu.log" 2>&1 \
        || { tail -40 "$OUT/multi_gpu.log"; exit 1; }
    CUDA_VISIBLE_DEVICES= NPROC=$N bash examples/run_ppo_tiny.sh "${MULTI[@]}" --log-dir "$OUT/multi_cpu" \
        > "$OUT/multi_cpu.log" 2>&1 || { tail -40 "$OUT/multi_cpu.log"; exit 1; }
    python3 -m puzzle.tools.compare_metrics "$OUT/multi_cpu/metrics.jsonl" "$OUT/multi_gpu/metrics.jsonl" \
        --rtol 1e-4 --atol 1e-6 $CLIP_COUNTS
fi
# 4. the multi-rank paths on CUDA tensors with ranks sharing one GPU over gloo, each against its CPU
#    twin: (2,1,2) and (1,2,2), time-sharing, the switch, a checkpoint resumed at another layout,
#    generate at T = 2 (scripts/gpu_multirank.sh)
step "tiny PPO and GRPO, 4 ranks sharing GPU 0 over gloo: layouts, time-sharing, switch, checkpoints"
CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0} MULTI_DIR="$OUT/multirank" bash scripts/gpu_multirank.sh
# 5. MoE on one GPU: fp32 against the CPU twin; bf16 with the graphed static MoE decode step
MOE=(--num-experts 4 --moe-ffn-hidden-size 32 --moe-router-topk 2 --moe-aux-loss-coeff 0.01)
step "tiny PPO with a MoE actor, fp32, 1 GPU, against the CPU"
NPROC=1 bash examples/run_ppo_tiny.sh "${ONE_RANK[@]}" "${MOE[@]}" --log-dir "$OUT/moe_gpu" > "$OUT/moe_gpu.log" 2>&1 \
    || { tail -40 "$OUT/moe_gpu.log"; exit 1; }
CUDA_VISIBLE_DEVICES= NPROC=1 bash examples/run_ppo_tiny.sh "${ONE_RANK[@]}" "${MOE[@]}" --log-dir "$OUT/moe_cpu" \
    > "$OUT/moe_cpu.log" 2>&1 || { tail -40 "$OUT/moe_cpu.log"; exit 1; }
python3 -m puzzle.tools.compare_metrics "$OUT/moe_cpu/metrics.jsonl" "$OUT/moe_gpu/metrics.jsonl" \
    --rtol 1e-4 --atol 1e-6 $CLIP_COUNTS
step "tiny PPO with a MoE actor, bf16, graphed static MoE decode: generation-vs-scoring log-prob difference"
NPROC=1 bash examples/run_ppo_tiny.sh "${ONE_RANK[@]}" "${MOE[@]}" --bf16 --cuda-graph-generation \
    --log-dir "$OUT/moe_bf16_graphs" > "$OUT/moe_bf16_graphs.log" 2>&1 || { tail -40 "$OUT/moe_bf16_graphs.log"; exit 1; }
python3 - "$OUT/moe_bf16_graphs/metrics.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    m = json.loads(line)
    print({k: m.get(k) for k in ("iteration", "reward_mean", "moe_aux_loss", "gen_score_logprob_diff_max",
                                 "gen_score_logprob_diff_mean")})
PY
step "graphed static MoE decode step (8 experts, top-2), ~1.1B-shaped, batch 64"
torchrun --standalone --nproc-per-node 1 -m puzzle.bench.decode_step --num-experts 8 | tee "$OUT/moe_decode_step.json"
step "grouped-GEMM experts against SequentialMLP, ~1.1B-shaped with 8 experts (top-2), 4096 tokens, bf16"
torchrun --standalone --nproc-per-node 1 -m puzzle.bench.moe_experts | tee "$OUT/moe_experts.json"
echo; echo "gpu_smoke: all checks passed"
