"""Plan-search benchmark: similarity search vs exhaustive search on the PUZZLE configurations.

    python -m puzzle.bench.search [--only 7B/350M@8 ...] [--profile a100_80gb] [--no-exhaustive]

Prints one JSON object per line: ``config, world_size, batch, searched_cost, exhaustive_cost,
gap, search_seconds, exhaustive_seconds`` (wall clock), ``search_cpu_seconds,
exhaustive_cpu_seconds`` (this process's CPU time: robust when the machine is shared),
``plans_evaluated, exhaustive_plans_evaluated, space_size`` and the searched layout, placements
and plans. Costs are estimated seconds per PPO
iteration with the given profile. Configurations: PUZZLE Table 2 (LLaMA shapes of Table 1,
prompt 256 + generation 256 tokens, 1 PPO epoch, micro-batch 4) and two 64-GPU cases.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import List, Optional, Tuple

from puzzle.plan import LLAMA_SHAPES, PPOJob, PPOWorkload, exhaustive_search, load_profile, similarity_search

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
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="configurations to run, e.g. 7B/350M@8")
    ap.add_argument("--profile", default="a100_80gb", help="bundled profile name or JSON path")
    ap.add_argument("--no-exhaustive", action="store_true", help="skip the exhaustive verification")
    ap.add_argument("--micro-batch-size", type=int, default=4)
    args = ap.parse_args(argv)
    known = {config_name(a, c, g) for a, c, g, _ in CONFIGS}
    bad = [o for o in args.only or [] if o not in known]
    if bad:
        ap.error(f"unknown configuration(s) {bad}; known: {sorted(known)}")
    run(args.only, args.profile, not args.no_exhaustive, args.micro_batch_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
