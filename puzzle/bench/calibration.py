"""Calibration of the cost model against the tiny PPO run, and SearchResult -> train_ppo.py flags.

* :func:`plan_flags`: the ``train_ppo.py`` layout/placement flags that run a :class:`SearchResult`.
* :func:`tiny_workload` / :func:`tiny_shape` / :func:`default_tiny_plans`: the workload, model shape
  and plans of ``examples/run_ppo_tiny.sh`` (its defaults), as the cost model sees them;
  :func:`tiny_arch`: its model as a ModelArch.
* :func:`estimate_stages`: the cost model's generation / scoring / training seconds of a run with
  given plans and placements (same stage boundaries as ``PPOTrainer.step``'s ``time_*`` metrics:
  the actor's train->generation switch overlaps its last optimizer step, so it counts in training;
  with ``--reward-fn`` there is no reward-model forward).
* :func:`run_tiny`: run the tiny PPO script with extra flags; medians of the per-stage times
  (iteration 1, the warm-up, skipped); :func:`pooled_medians` pools the iterations of several runs.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional

from puzzle.model_shape import ModelShape
from puzzle.parallel.plan import ParallelPlan
from puzzle.plan_search.cost_model import CostModel, PPOWorkload, ppo_roles, stage_seconds

REPO = Path(__file__).resolve().parents[2]
TINY_SCRIPT = REPO / "examples" / "run_ppo_tiny.sh"

#: examples/run_ppo_tiny.sh defaults
TINY = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
            seq_length=64, vocab_size=259, make_vocab_size_divisible_by=128, rollout_batch_size=16,
            global_batch_size=16, micro_batch_size=2, ppo_epochs=2, max_new_tokens=16, seed=1234, world_size=4)


class PlanFlagsError(ValueError):
    """A SearchResult that train_ppo.py cannot run as such."""


#: the models the tiny run builds (its reward is --reward-fn: no reward model)
TINY_ROLES = ("actor", "critic", "ref")


def plan_flags(result, strict: bool = False) -> List[str]:
    """The tiny run's train_ppo.py flags for a SearchResult (see puzzle.arguments.plan_flags, which
    reads the same plan as a document: the layout flags of its roles, --actor-gen-*, and the
    placements)."""
    from puzzle.arguments import ArgumentError
    from puzzle.arguments import plan_flags as flags_of_document

    try:
        return flags_of_document(result.to_dict(), strict=strict, roles=TINY_ROLES)
    except ArgumentError as e:
        raise PlanFlagsError(str(e)) from None


# ---- the tiny run as the cost model sees it -----------------------------------------------------
def tiny_arch():
    """The tiny run's model (examples/run_ppo_tiny.sh's model flags) as a ModelArch."""
    from puzzle.config import ModelArch

    return ModelArch.llama(num_layers=TINY["num_layers"], hidden_size=TINY["hidden_size"],
                           ffn_hidden_size=TINY["ffn_hidden_size"], num_attention_heads=TINY["num_attention_heads"],
                           num_query_groups=TINY["num_query_groups"], vocab_size=TINY["vocab_size"],
                           seq_length=TINY["seq_length"],
                           make_vocab_size_divisible_by=TINY["make_vocab_size_divisible_by"])


def tiny_shape() -> ModelShape:
    v = TINY["vocab_size"]
    m = TINY["make_vocab_size_divisible_by"]
    return ModelShape(TINY["num_layers"], TINY["hidden_size"], TINY["ffn_hidden_size"], TINY["num_attention_heads"],
                      TINY["num_query_groups"], -(-v // m) * m, True)


def tiny_prompt_len(iterations: range = range(2, 5)) -> int:
    """Mean (over the given 1-based iterations) of the longest prompt of the rollout batch: the
    scored/trained sequences are that + max_new_tokens wide."""
    from puzzle.data.prompts import PromptLoader, bundled_prompts_path, load_prompt_dataset
    from puzzle.data.tokenizers import build_tokenizer

    tok = build_tokenizer("ByteLevelTokenizer", None)
    ds = load_prompt_dataset(bundled_prompts_path(), tok, "prompt",
                             max_prompt_len=TINY["seq_length"] - TINY["max_new_tokens"])
    loader = PromptLoader(ds.prompts, TINY["rollout_batch_size"], seed=TINY["seed"])
    lens = []
    for it in range(1, max(iterations) + 1):
        b = next(loader)
        if it in iterations:
            lens.append(max(len(p) for p in b.prompts))
    return int(round(statistics.mean(lens)))


def tiny_workload(prompt_len: Optional[int] = None) -> PPOWorkload:
    return PPOWorkload(rollout_batch_size=TINY["rollout_batch_size"], prompt_len=prompt_len or tiny_prompt_len(),
                       gen_len=TINY["max_new_tokens"], micro_batch_size=TINY["micro_batch_size"],
                       ppo_epochs=TINY["ppo_epochs"],
                       ppo_minibatches=TINY["rollout_batch_size"] // TINY["global_batch_size"],
                       distributed_optimizer=False)


def default_tiny_plans() -> dict:
    """The script's layout: actor and ref (P,D,T) = (2,1,2), critic (1,2,2), sequential stages."""
    a = ParallelPlan(2, 1, 2)
    return {"plans": {"actor": {"training": a, "generation": a, "scoring": a},
                      "critic": {"training": ParallelPlan(1, 2, 2), "scoring": ParallelPlan(1, 2, 2)},
                      "ref": {"scoring": a}},
            "placements": {"scoring": "sequential", "training": "sequential"}}


def estimate_stages(profile, workload: PPOWorkload, plans: dict, placements: dict, shape: Optional[ModelShape] = None,
                    reward_model: bool = False) -> Dict[str, float]:
    """Cost-model seconds of generation, scoring and training of the tiny run's shapes (see the
    module docstring); ``plans`` as in SearchResult.plans."""
    shape = shape or tiny_shape()
    plans = {m: st for m, st in plans.items() if reward_model or m != "reward"}
    return stage_seconds(CostModel(profile, workload), ppo_roles(shape, shape), plans, placements)


# ---- running the tiny PPO script -------------------------------------------------------------------
def run_tiny(extra: List[str], log_dir: str, train_iters: int = 4, nproc: int = 4, timeout: int = 900) -> dict:
    """Run examples/run_ppo_tiny.sh with ``extra`` flags; per-stage medians without iteration 1."""
    os.makedirs(log_dir, exist_ok=True)
    metrics = Path(log_dir) / "metrics.jsonl"
    if metrics.exists():
        metrics.unlink()
    env = dict(os.environ, NPROC=str(nproc), OMP_NUM_THREADS="1")
    cmd = ["bash", str(TINY_SCRIPT), "--train-iters", str(train_iters), "--log-dir", log_dir, *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0 or not metrics.exists():
        tail = "\n".join((proc.stdout + "\n" + proc.stderr).splitlines()[-30:])
        raise RuntimeError(f"tiny run failed (rc={proc.returncode}): {' '.join(cmd)}\n{tail}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "time_generate" in r]
    timed = [r for r in rows if r.get("iteration", 0) > 1] or rows
    per_iteration = {s: [r[f"time_{k}"] for r in timed] for s, k in STAGE_METRICS}
    per_iteration["iteration"] = [r["time_generate"] + r["time_score"] + r["time_train"] for r in timed]
    med = pooled_medians([per_iteration])
    med["per_iteration"] = per_iteration
    med["wall_s"] = round(wall, 1)
    return med


#: calibration stage -> the run's time_* metric
STAGE_METRICS = (("generation", "generate"), ("scoring", "score"), ("training", "train"))


def pooled_medians(runs: List[dict]) -> dict:
    """Per-stage medians over the timed iterations of several runs (their ``per_iteration`` lists)."""
    keys = [s for s, _ in STAGE_METRICS] + ["iteration"]
    med = {k: statistics.median(v for r in runs for v in r[k]) for k in keys}
    med["iterations_timed"] = sum(len(r["iteration"]) for r in runs)
    return med


def estimate_error(est: float, measured: float) -> float:
    return abs(est - measured) / measured if measured > 0 else math.inf
