"""Plan-search benchmark: similarity search vs exhaustive search on the PUZZLE configurations.

    python -m puzzle.bench.search [--only 7B/350M@8 ...] [--profile a100_80gb] [--no-exhaustive]
    python -m puzzle.bench.search --moe [--only "Mixtral-8x7B GRPO@32" ...]
    python -m puzzle.bench.search --calibrate [--cpu-profile FILE] [--train-iters 6]

Prints one JSON object per line: ``config, world_size, batch, searched_cost, exhaustive_cost,
gap, search_seconds, exhaustive_seconds`` (wall clock), ``search_cpu_seconds,
exhaustive_cpu_seconds`` (this process's CPU time: robust when the machine is shared),
``plans_evaluated, exhaustive_plans_evaluated, space_size`` and the searched layout, placements
and plans. Costs are estimated seconds per PPO
iteration with the given profile. Configurations: PUZZLE Table 2 (LLaMA shapes of Table 1,
prompt 256 + generation 256 tokens, 1 PPO epoch, micro-batch 4) and two 64-GPU cases. ``--moe``:
the mixture-of-experts jobs of :data:`MOE_JOBS` instead (offload during inference on).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import List, Optional, Tuple

from puzzle.plan_search import (LLAMA_SHAPES, ModelShape, PPOJob, PPOWorkload, exhaustive_search, load_profile,
                                similarity_search)

#: (actor, critic, GPUs, rollout batch): PUZZLE Table 2, plus 64-GPU configurations.
CONFIGS: List[Tuple[str, str, int, int]] = [
    ("7B", "350M", 8, 128),
    ("7B", "7B", 16, 256),
    ("13B", "350M", 16, 256),
    ("13B", "7B", 16, 256),
    ("33B", "7B", 32, 128),
    ("33B", "7B", 64, 256),
    ("70B", "7B", 64, 512),
]


#: Qwen3-30B-A3B (48 layers, 128 experts of 768, top-8) and Mixtral-8x7B (32 layers, 8 experts of 14336, top-2)
QWEN3_30B_A3B = ModelShape(num_layers=48, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=32,
                           num_query_groups=4, vocab_size=151936, kv_channels=128, num_experts=128,
                           moe_router_topk=8, moe_ffn_hidden_size=768)
MIXTRAL_8X7B = ModelShape(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                          num_query_groups=8, vocab_size=32000, num_experts=8, moe_router_topk=2,
                          moe_ffn_hidden_size=14336)
_GRPO = ("actor", "ref")
#: name -> (GPUs, actor, critic, roles, workload): GRPO runs have no critic (a stand-in shape, never placed)
MOE_JOBS = {
    "Qwen3-30B-A3B GRPO@16": (16, QWEN3_30B_A3B, QWEN3_30B_A3B, _GRPO, PPOWorkload(
        128, prompt_len=512, gen_len=1024, micro_batch_size=1, offload_during_inference=True)),
    "Qwen3-30B-A3B GRPO@32": (32, QWEN3_30B_A3B, QWEN3_30B_A3B, _GRPO, PPOWorkload(
        256, prompt_len=512, gen_len=1024, micro_batch_size=1, offload_during_inference=True)),
    "Mixtral-8x7B GRPO@32": (32, MIXTRAL_8X7B, MIXTRAL_8X7B, _GRPO, PPOWorkload(
        128, micro_batch_size=4, offload_during_inference=True)),
    "Mixtral-8x7B PPO@32": (32, MIXTRAL_8X7B, LLAMA_SHAPES["7B"], ("actor", "critic", "ref", "reward"), PPOWorkload(
        128, micro_batch_size=2, offload_during_inference=True)),
}


def config_name(actor: str, critic: str, gpus: int) -> str:
    return f"{actor}/{critic}@{gpus}"


def run(only: Optional[List[str]] = None, profile_name: str = "a100_80gb", exhaustive: bool = True,
        micro_batch_size: int = 4) -> List[dict]:
    profile = load_profile(profile_name)
    rows = []
    for actor, critic, gpus, batch in CONFIGS:
        name = config_name(actor, critic, gpus)
        if only and name not in only:
            continue
        job = PPOJob(gpus, LLAMA_SHAPES[actor], LLAMA_SHAPES[critic],
                     PPOWorkload(batch, prompt_len=256, gen_len=256, micro_batch_size=micro_batch_size), profile)
        rows.append(_row(name, job, exhaustive))
    return rows


def run_moe(only: Optional[List[str]] = None, profile_name: str = "a100_80gb", exhaustive: bool = True) -> List[dict]:
    """The rows of :data:`MOE_JOBS`."""
    profile = load_profile(profile_name)
    rows = []
    for name, (gpus, actor, critic, roles, workload) in MOE_JOBS.items():
        if not only or name in only:
            rows.append(_row(name, PPOJob(gpus, actor, critic, workload, profile, roles=roles), exhaustive))
    return rows


def _row(name: str, job: PPOJob, exhaustive: bool) -> dict:
    """Search ``job`` (and exhaustively); print and return its JSON row."""
    gpus, batch = job.world_size, job.workload.rollout_batch_size
    t0, c0 = time.perf_counter(), time.process_time()
    res = similarity_search(job)
    t_sim, c_sim = time.perf_counter() - t0, time.process_time() - c0
    row = {"config": name, "world_size": gpus, "batch": batch, "searched_cost": round(res.total_time, 4)}
    if exhaustive:
        t0, c0 = time.perf_counter(), time.process_time()
        ex = exhaustive_search(job)
        t_ex, c_ex = time.perf_counter() - t0, time.process_time() - c0
        row.update(exhaustive_cost=round(ex.total_time, 4),
                   gap=round((res.total_time - ex.total_time) / ex.total_time, 5))
    row["search_seconds"] = round(t_sim, 3)
    if exhaustive:
        row["exhaustive_seconds"] = round(t_ex, 3)
    row["search_cpu_seconds"] = round(c_sim, 3)
    if exhaustive:
        row["exhaustive_cpu_seconds"] = round(c_ex, 3)
    row["plans_evaluated"] = res.plans_evaluated
    if exhaustive:
        row["exhaustive_plans_evaluated"] = ex.plans_evaluated
    d = res.to_dict()
    row.update(space_size=res.space_size, layout=d["layout"], placements=d["placements"],
               stage_times=d["stage_times"], switch_bytes=d["switch_bytes"], peak_memory_gib=d["peak_memory_gib"],
               plans={m: st.get("training", st.get("scoring")) if m != "actor" else
                      {"train": st["training"], "gen": st["generation"]} for m, st in d["plans"].items()})
    print(json.dumps(row), flush=True)
    return row


def calibrate(cpu_profile: Optional[str] = None, train_iters: int = 6, log_root: str = "tmp/calibrate",
              procs: int = 4, parts: int = 2) -> List[dict]:
    """Cost model vs the CPU tiny PPO run (examples/run_ppo_tiny.sh, 4 ranks): profile the tiny
    shapes on this machine (or load ``cpu_profile``), run the script's default plan, compare per-stage
    estimates with the measured medians (iteration 1 skipped); then run the plan the similarity
    search picks with that profile (world 4) and compare iteration times. Prints two JSON rows.

    A shared machine drifts in speed by ~10 % from one minute to the next, and one run of 4 ranks
    on 2 cores can be 20-40 % faster or slower than the next (probably how its ranks happen to
    share the cores, which lasts for the run); either alone would move the comparison by as much.
    So the profile is taken in ``parts`` worlds of 1/parts of the repeats each, alternated with as
    many runs of the default plan (profile, run, profile, run, ...): the merged profile and the
    pooled iterations span the same minutes and average over as many worlds."""
    import os

    from puzzle.bench.calibration import (default_tiny_plans, estimate_error, estimate_stages, plan_flags,
                                         pooled_medians, run_tiny, tiny_shape, tiny_workload)
    from puzzle.tools.profile import SHAPES, measure_raw, merge_raw, save_built_profile

    runs = []
    if cpu_profile and os.path.exists(cpu_profile):
        prof_src = cpu_profile
        profile = load_profile(cpu_profile)
        runs.append(run_tiny([], os.path.join(log_root, "default"), train_iters))
    else:
        prof_src = os.path.join(log_root, "cpu_tiny_profile.json")
        os.makedirs(log_root, exist_ok=True)
        spec = {"shape": dict(SHAPES["tiny"]), "tp_sizes": [1, 2], "micro_batch_sizes": [1, 2, 4],
                "seq_lengths": [32, 64], "decode_batch_sizes": [1, 2, 4, 8], "procs": procs,
                "repeats": -(-15 // parts), "rounds": None, "decode_steps": 16, "name": None}
        raws = []
        for i in range(parts):
            raws.append(measure_raw(spec))
            runs.append(run_tiny([], os.path.join(log_root, f"default{i}"), train_iters))
        profile = save_built_profile(spec, merge_raw(raws), prof_src, log=lambda m: print(m, file=sys.stderr))
    meas = pooled_medians([r["per_iteration"] for r in runs])
    w = tiny_workload()
    rows = []
    base = default_tiny_plans()
    est = estimate_stages(profile, w, base["plans"], base["placements"])
    err = {k: round(estimate_error(est[k], meas[k]), 3) for k in est}
    rows.append({"config": "calibrate tiny PPO (CPU, 4 ranks), default plan", "profile": prof_src,
                 "plans": "actor/ref (2,1,2), critic (1,2,2), sequential",
                 "workload": {"rollout": w.rollout_batch_size, "prompt_len": w.prompt_len, "gen_len": w.gen_len,
                              "micro_batch": w.micro_batch_size, "epochs": w.ppo_epochs},
                 "estimated_s": {k: round(v, 4) for k, v in est.items()},
                 "measured_median_s": {k: round(meas[k], 4) for k in est}, "estimate_error": err,
                 "iterations_timed": meas["iterations_timed"], "runs": len(runs)})
    print(json.dumps(rows[-1]), flush=True)
    # colocated layouts only: the device set of the default plan it is compared with (as the
    # figures in docs/benchmarks.md were measured)
    job = PPOJob(procs, tiny_shape(), tiny_shape(), w, profile, disjoint_fractions=())
    res = similarity_search(job)
    flags = plan_flags(res)
    srch = run_tiny(flags, os.path.join(log_root, "searched"), train_iters)
    d = res.to_dict()
    est_s = estimate_stages(profile, w, res.plans, res.placements)
    rows.append({"config": "tiny PPO (CPU, world 4): searched plan vs default plan", "searched_layout": d["layout"],
                 "searched_plans": d["plans"], "searched_placements": d["placements"], "plan_flags": " ".join(flags),
                 "searched_estimated_iteration_s": round(sum(est_s.values()), 4),
                 "default_estimated_iteration_s": round(sum(est.values()), 4),
                 "searched_measured_iteration_s": round(srch["iteration"], 4),
                 "default_measured_iteration_s": round(meas["iteration"], 4),
                 "searched_measured_s": {k: round(srch[k], 4) for k in est},
                 "speedup": round(meas["iteration"] / srch["iteration"], 3)})
    print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="configurations to run, e.g. 7B/350M@8")
    ap.add_argument("--profile", default="a100_80gb", help="bundled profile name or JSON path")
    ap.add_argument("--no-exhaustive", action="store_true", help="skip the exhaustive verification")
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--moe", action="store_true", help="the mixture-of-experts jobs (MOE_JOBS) instead")
    ap.add_argument("--calibrate", action="store_true",
                    help="only the calibration rows: cost model vs the CPU tiny PPO run (profiles this machine)")
    ap.add_argument("--cpu-profile", default=None, help="with --calibrate: a saved CPU profile instead of profiling")
    ap.add_argument("--train-iters", type=int, default=6, help="with --calibrate: iterations of each tiny run")
    ap.add_argument("--log-dir", default="tmp/calibrate", help="with --calibrate: where the tiny runs log")
    args = ap.parse_args(argv)
    if args.calibrate:
        calibrate(args.cpu_profile, args.train_iters, args.log_dir)
        return 0
    known = set(MOE_JOBS) if args.moe else {config_name(a, c, g) for a, c, g, _ in CONFIGS}
    bad = [o for o in args.only or [] if o not in known]
    if bad:
        ap.error(f"unknown configuration(s) {bad}; known: {sorted(known)}")
    if args.moe:
        run_moe(args.only, args.profile, not args.no_exhaustive)
    else:
        run(args.only, args.profile, not args.no_exhaustive, args.micro_batch_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
