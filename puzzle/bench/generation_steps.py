"""Benchmark: the cost model's generation estimate against ``generate()`` timed directly, split
into the prefill and the decode steps, at the tiny PPO run's generation workload on CPU.

    python -m puzzle.bench.generation_steps [--layouts 2,1,2 1,2,2] [--profile cpu_tiny_4ranks]
        [--pairs 8]

One world of 4 ranks builds the tiny run's actor at each layout (P,D,T) and generates its
rollout batch (16 prompts of the calibration's mean prompt length, random tokens, 16 new tokens,
sampled) over and over: a 1-token and a 16-token call back to back, ``--pairs`` times after one
warm-up pair. Per decode step: the median of (t16 - t1) / 15; prefill: the median of t1 (the
prefill and its first token). Prints one JSON row per layout with those figures and the cost
model's (``generation_cost``: ``extra`` the prefill, the rest over gen_len - 1 steps) from the
given profile. No timed asserts: figures for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

WORLD = 4


def _parse_layout(text: str):
    from puzzle.parallel.plan import ParallelPlan

    p, d, t = (int(v) for v in text.split(","))
    if p * d * t != WORLD:
        raise SystemExit(f"--layouts: {text} is not a layout of {WORLD} ranks")
    return ParallelPlan(p, d, t)


def _worker(layouts: List[str], pairs: int, out: str) -> None:
    import megatron_patches

    megatron_patches.apply()
    import torch
    import torch.distributed as dist

    from puzzle.bench.calibration import TINY, tiny_arch, tiny_prompt_len
    from puzzle.parallel.groups import destroy_layouts, init_distributed, layout_for
    from puzzle.rollout.generation import generate
    from puzzle.rollout.sampling import SamplingParams
    from puzzle.engine.model_engine import ModelEngine

    rank, _ = init_distributed()
    arch = tiny_arch()
    n = TINY["max_new_tokens"]
    prompt_len = tiny_prompt_len()
    rows = []
    for text in layouts:
        plan = _parse_layout(text)
        layout = layout_for(plan)
        eng = ModelEngine("actor", arch, layout, trainable=True)
        g = torch.Generator().manual_seed(1234 + layout.d)
        prompts = [[int(v) for v in torch.randint(3, TINY["vocab_size"], (prompt_len,), generator=g)]
                   for _ in range(TINY["rollout_batch_size"] // plan.D)]
        steps, firsts = [], []
        for it in range(pairs + 1):
            t = {}
            for k in (1, n):
                dist.barrier()
                t0 = time.perf_counter()
                generate(eng, prompts, SamplingParams(max_new_tokens=k, temperature=1.0, eos_id=None, pad_id=0),
                         seed=it)
                t[k] = time.perf_counter() - t0
            if it:
                steps.append((t[n] - t[1]) / (n - 1))
                firsts.append(t[1])
        rows.append({"layout": str(plan), "prompts_per_replica": len(prompts), "prompt_len": prompt_len,
                     "new_tokens": n, "measured_step_s": statistics.median(steps),
                     "measured_prefill_s": statistics.median(firsts), "pairs": pairs})
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.barrier()
    destroy_layouts()
    dist.destroy_process_group()


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", nargs="+", default=["2,1,2", "1,2,2"], help="P,D,T of 4 ranks")
    ap.add_argument("--profile", default="cpu_tiny_4ranks", help="profile JSON or bundled name for the estimates")
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker_out:
        _worker(args.layouts, args.pairs, args.worker_out)
        return 0
    plans = [_parse_layout(t) for t in args.layouts]  # refuse a bad layout before any process starts
    from puzzle.bench.calibration import tiny_shape, tiny_workload
    from puzzle.plan_search import load_profile
    from puzzle.plan_search.cost_model import CostModel, ppo_roles

    profile = load_profile(args.profile)
    with tempfile.TemporaryDirectory(prefix="puzzle-gensteps-") as tmp:
        out = os.path.join(tmp, "rows.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
               "-m", "puzzle.bench.generation_steps", "--worker-out", out, "--pairs", str(args.pairs),
               "--layouts", *args.layouts]
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0 or not os.path.exists(out):
            print("\n".join((proc.stdout + proc.stderr).splitlines()[-30:]), file=sys.stderr)
            return 1
        rows = json.loads(Path(out).read_text())
    w = tiny_workload()
    actor = ppo_roles(tiny_shape(), tiny_shape())["actor"]
    for plan, row in zip(plans, rows):
        cost = CostModel(profile, w).generation_cost(actor, plan)
        row.update(profile=args.profile, estimated_step_s=round((cost.total - cost.extra) / (w.gen_len - 1), 5),
                   estimated_prefill_s=round(cost.extra, 5), measured_step_s=round(row["measured_step_s"], 5),
                   measured_prefill_s=round(row["measured_prefill_s"], 5))
        row["step_estimate_over_measured"] = round(row["estimated_step_s"] / row["measured_step_s"], 3)
        row["prefill_estimate_over_measured"] = round(row["estimated_prefill_s"] / row["measured_prefill_s"], 3)
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
