"""GPU figures of a finished PPO run: ``python -m puzzle.bench.gpu_report --metrics FILE -- FLAGS``.

FLAGS are the run's own train_ppo.py flags. Measured on this machine's GPU in the same call:
the memory bandwidth (a large device-to-device copy, bytes read + written) and the bf16 matrix
rate (an 8192^3 product). Printed as one JSON object:

- per-stage seconds (mean over the iterations after ``--skip`` warm-up ones);
- generation tokens/s and its ratio to the decode bound: a decode step must read every weight
  of the actor and the micro-batch's KV cache once, so at best it generates ``gen_mbs`` tokens
  per (weight bytes + KV bytes) / bandwidth. Our measured time also holds the prefill, sampling
  and rows that finished early, so the ratio is a lower bound on the decode loop's efficiency;
- training MFU: 6 * params * tokens for actor and critic per epoch (attention FLOPs left out, as
  usual for MFU), over the measured training time and the measured bf16 matrix rate (and over
  the datasheet peak when the GPU is a known one);
- peak GPU memory per stage (from the run's metrics) against the dry-run estimate for the flags.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, List

#: dense bf16 tensor-core peaks from the vendors' datasheets (FLOP/s)
DATASHEET_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def measure_bandwidth(device, nbytes: int = 2 ** 31, repeats: int = 10) -> float:
    """Device memory bandwidth (bytes/s): read + write bytes of a large copy over its time."""
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        b.copy_(a)
    end.record()
    end.synchronize()
    return 2 * nbytes * repeats / (start.elapsed_time(end) / 1e3)


def measure_matmul(device, n: int = 8192, repeats: int = 10) -> float:
    import torch

    x = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    y = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        x @ y
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        x @ y
    end.record()
    end.synchronize()
    return 2 * n ** 3 * repeats / (start.elapsed_time(end) / 1e3)


def decode_bound_tokens_per_s(actor, gen_mbs: int, context: int, bandwidth: float,
                              dtype_bytes: int = 2) -> float:
    """Tokens/s if every decode step only read the actor's weights and the KV cache once."""
    kv = actor.num_layers * actor.kv_bytes_per_token(1, dtype_bytes)  # a token's keys and values, all layers
    step_bytes = actor.param_count(True) * dtype_bytes + gen_mbs * context * kv
    return gen_mbs * bandwidth / step_bytes


def report(metrics: List[dict], cfg, skip: int, bandwidth: float, matmul: float, gpu: str) -> Dict:
    from puzzle.config import ROLES
    from puzzle.plan_search.command import shapes_from_config, stage_memory_estimate
    from puzzle.plan_search.profile_data import load_profile

    rows = metrics[skip:] or metrics
    mean = lambda k: sum(r[k] for r in rows) / len(rows)  # noqa: E731
    ppo = cfg.ppo
    shapes = shapes_from_config(cfg)
    actor = shapes["actor"]
    B, R = ppo.rollout_batch_size, ppo.max_new_tokens
    gen_D = cfg.roles["actor"].gen_plan.D
    gen_mbs = ppo.generation_micro_batch_size or B // gen_D
    tokens_per_s = B * mean("response_length_mean") / mean("time_generate")
    context = ppo.max_prompt_length + R // 2  # the KV cache's mean length over the decode
    bound = decode_bound_tokens_per_s(actor, gen_mbs, context, bandwidth) * gen_D
    seq = ppo.max_prompt_length + mean("response_length_mean")
    train_flops = sum(6 * shapes[r].param_count(ROLES[r].lm_head) * B * seq * ppo.ppo_epochs
                      for r in shapes if ROLES[r].trainable)
    out = {
        "gpu": gpu, "iterations": len(metrics), "skipped_warmup": skip,
        "stage_seconds": {k: mean(f"time_{k}") for k in ("generate", "score", "train")},
        "generation_tokens_per_s": tokens_per_s,
        "decode_bound_tokens_per_s": bound,
        "ratio_to_decode_bound": tokens_per_s / bound,
        "measured_bandwidth_tb_s": bandwidth / 1e12,
        "measured_bf16_matmul_tflops": matmul / 1e12,
        "training_mfu_vs_measured_matmul": train_flops / mean("time_train") / matmul,
    }
    peak = next((v for k, v in DATASHEET_BF16.items() if k in gpu), None)
    if peak:
        out["training_mfu_vs_datasheet"] = train_flops / mean("time_train") / peak
    est = stage_memory_estimate(cfg, load_profile("a100_80gb"))
    names = {"generate": "generation", "score": "scoring", "train": "training"}
    out["peak_memory_gib"] = {
        k: {"measured": max(r.get(f"mem_peak_gib_{k}", 0.0) for r in metrics),
            "dry_run_estimate": est.get(v, 0.0) / 2 ** 30} for k, v in names.items()}
    return out


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print("usage: python -m puzzle.bench.gpu_report --metrics FILE [--skip N] -- TRAIN_FLAGS",
              file=sys.stderr)
        return 2
    cut = argv.index("--")
    p = argparse.ArgumentParser(prog="puzzle.bench.gpu_report")
    p.add_argument("--metrics", required=True)
    p.add_argument("--skip", type=int, default=1, help="warm-up iterations left out of the means")
    args = p.parse_args(argv[:cut])
    import megatron_patches

    megatron_patches.apply()
    import torch

    from puzzle.arguments import config_for_planning, parse_args

    if not torch.cuda.is_available():
        print("error: puzzle.bench.gpu_report needs a CUDA device", file=sys.stderr)
        return 2
    cfg = config_for_planning(parse_args(argv[cut + 1:]))
    metrics = [json.loads(line) for line in open(args.metrics) if line.strip()]
    device = torch.device(torch.cuda.current_device())
    out = report(metrics, cfg, args.skip, measure_bandwidth(device), measure_matmul(device),
                 torch.cuda.get_device_name(device))
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
