"""The plan search and dry-run commands on top of the pure planner.

``python search_plan.py --world-size N --ranks-per-node 8 [--profile FILE] <model flags>`` takes
the same Megatron-style model, PPO and role flags as train_ppo.py, searches the plan of every
model and stage (similarity-guided, optionally checked against exhaustive search) and prints it,
or writes it with ``--save-plan FILE`` for ``train_ppo.py --plan-file FILE``.
``train_ppo.py --dry-run`` validates every flag and prints the layouts with a per-device memory
estimate without allocating anything.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from typing import Dict, List, Optional

from puzzle.model_shape import ModelShape
from puzzle.plan_search.cost_model import CostModel, PPOWorkload, ppo_roles, stage_seconds
from puzzle.plan_search.memory_model import LOGITS_CHUNK_BYTES, GiB, MemoryModel, fmt_plan
from puzzle.plan_search.profile_data import load_profile


def shapes_from_config(cfg) -> Dict[str, ModelShape]:
    """Every role's ModelShape (``ModelArch.shape``)."""
    return {role: spec.arch.shape for role, spec in cfg.roles.items()}


def actor_lora(cfg, role: str = "actor"):
    """(dim, target modules) of a LoRA actor (or critic: ``role``; the planner's ModelRole.lora), else None."""
    lora = cfg.role_lora(role)
    return (lora.dim, tuple(lora.target_modules)) if lora.enabled else None


def roles_from_config(cfg):
    """The planner's ModelRole of every role the run builds."""
    shapes = shapes_from_config(cfg)
    roles = ppo_roles(shapes["actor"], shapes.get("critic"), shapes.get("ref"), shapes.get("reward"),
                      actor_lora=actor_lora(cfg), critic_lora=actor_lora(cfg, "critic"))
    return {r: roles[r] for r in shapes}


def workload_from_config(cfg) -> PPOWorkload:
    ppo = cfg.ppo
    return PPOWorkload(rollout_batch_size=ppo.num_samples, prompt_len=ppo.max_prompt_length,
                       gen_len=ppo.max_new_tokens, micro_batch_size=ppo.micro_batch_size,
                       ppo_epochs=ppo.ppo_epochs,
                       ppo_minibatches=ppo.num_samples // ppo.mini_batch_size,
                       distributed_optimizer=cfg.optim.use_distributed_optimizer,
                       generation_micro_batch_size=ppo.generation_micro_batch_size,
                       cuda_graphs=ppo.cuda_graph_generation,
                       recompute_granularity=cfg.levers.recompute_granularity,
                       recompute_method=cfg.levers.recompute_method,
                       recompute_num_layers=cfg.levers.recompute_num_layers,
                       offload_during_inference=cfg.levers.rl_offload_optimizer_during_inference,
                       packed=ppo.use_remove_padding,
                       train_token_budget=ppo.ppo_max_token_len_per_gpu if ppo.use_dynamic_bsz else None,
                       score_token_budget=ppo.log_prob_max_token_len_per_gpu if ppo.use_dynamic_bsz else None)


def placement_from_config(cfg) -> Dict[str, Dict[str, object]]:
    """{model: {stage: plan}} of a validated RunConfig (the planner's view of a run)."""
    out = {}
    for role, spec in cfg.roles.items():
        stages = {"scoring": spec.plan}
        if spec.trainable:
            stages["training"] = spec.plan
        if role == "actor":
            stages["generation"] = spec.gen_plan
        out[role] = stages
    return out


def _memory_setup(cfg, profile):
    roles = roles_from_config(cfg)
    shadow = cfg.roles["actor"].gen_plan != cfg.roles["actor"].plan
    return MemoryModel(profile, workload_from_config(cfg)), placement_from_config(cfg), roles, shadow


def memory_estimate(cfg, profile) -> list:
    """The worst-stage MemoryReport of every rank under the run's layouts."""
    mem, placement, roles, shadow = _memory_setup(cfg, profile)
    return [mem.rank_report(r, placement, roles, shadow) for r in range(cfg.world_size)]


def stage_memory_estimate(cfg, profile) -> Dict[str, float]:
    """The busiest rank's estimated peak bytes in each stage (generation, scoring, training)."""
    mem, placement, roles, shadow = _memory_setup(cfg, profile)
    out: Dict[str, float] = {}
    for r in range(cfg.world_size):
        for rep in mem.stage_reports(r, placement, roles, shadow):
            out[rep.stage] = max(out.get(rep.stage, 0.0), rep.total)
    return out


def stage_estimate(cfg, profile) -> Dict[str, float]:
    """Estimated seconds per stage of the run's layouts and placements (training includes the
    actor's switch, as PPOTrainer's time_train does)."""
    return stage_seconds(CostModel(profile, workload_from_config(cfg)), roles_from_config(cfg),
                         placement_from_config(cfg), {"scoring": cfg.score_placement, "training": cfg.train_placement},
                         reference_is_actor_base=cfg.reference_is_actor_base)


def print_dry_run(cfg, profile, out=None) -> bool:
    """Print the dry-run report (to ``out``, default the current sys.stdout); returns whether every
    rank fits its device."""
    reports = memory_estimate(cfg, profile)
    print(f"dry run: every flag is valid; world size {cfg.world_size}; profile {profile.name}", file=out)
    for role, spec in cfg.roles.items():
        gen = f", generation {fmt_plan(spec.gen_plan)}" if role == "actor" else ""
        print(f"  {role:7s} {fmt_plan(spec.plan)}{gen}", file=out)
    for line in expert_lines(cfg) + lora_lines(cfg, profile):
        print("  " + line, file=out)
    print(f"  placements: scoring {cfg.score_placement}, training {cfg.train_placement}", file=out)
    est = stage_estimate(cfg, profile)
    print("  estimated stage seconds: " + ", ".join(f"{k} {v:.3f}" for k, v in est.items()), file=out)
    for line in lever_lines(cfg, profile):
        print("  " + line, file=out)
    for line in long_tail_report(cfg, profile, own_layouts=True).lines():
        print("  " + line, file=out)
    worst = max(reports, key=lambda r: r.total)
    print(f"  per-device memory estimate (worst stage, GiB; device {profile.device_memory_bytes / GiB:.0f}):",
          file=out)
    for rep in reports:
        print(f"    rank {rep.rank:3d}: {rep.total / GiB:7.2f} during {rep.stage}{'' if rep.fits else '  DOES NOT FIT'}",
              file=out)
    print("  worst: " + worst.describe(), file=out)
    fits = all(r.fits for r in reports)
    if not fits:
        print("error: the estimate exceeds device memory; try python search_plan.py with the same flags, "
              "--plan auto, smaller --rollout-batch-size/--max-new-tokens, or more ranks", file=out)
    return fits


def expert_lines(cfg) -> List[str]:
    """One line per MoE model: experts, active parameters and how its plan splits the experts."""
    lines = []
    for role, shape in shapes_from_config(cfg).items():
        if not shape.is_moe:
            continue
        plan = cfg.roles[role].plan
        lm_head = cfg.roles[role].description.lm_head
        lines.append(f"{role} experts: {shape.num_experts} per MoE layer in {shape.n_moe_layers} of {shape.num_layers} "
                     f"layers, top-{shape.moe_router_topk}, {shape.param_count(lm_head) / 1e9:.2f}B parameters "
                     f"({shape.active_param_count(lm_head) / 1e9:.2f}B active); E={plan.E}, ETP={plan.ETP}: "
                     f"{shape.num_experts // plan.E} experts per rank, EDP={plan.EDP}; "
                     f"{shape.moe_dispatcher} dispatcher")
    return lines


def lora_lines(cfg, profile) -> List[str]:
    """A LoRA actor (or critic): its trained parameters, and what the actor's reference (the base,
    adapters off) saves against a reference model of its own in the actor's layout (weights on each
    rank)."""
    if not (cfg.lora.enabled or cfg.critic_lora.enabled):
        return []
    from puzzle.model_shape import lora_expert_layer_params, lora_layer_params

    mem, _, roles, _ = _memory_setup(cfg, profile)
    lines = []
    for name in ("actor", "critic"):
        lora, role = cfg.role_lora(name), roles.get(name)
        if not lora.enabled or role is None:
            continue
        trained = role.shape.num_layers * (sum(lora_layer_params(role.shape, *role.lora))
                                           + sum(lora_expert_layer_params(role.shape, *role.lora)))
        head = "" if role.lm_head else ", its value head trained whole"
        lines.append(f"{name} LoRA: rank {lora.dim}, alpha {lora.alpha:g} on {','.join(lora.target_modules)}: "
                     f"{trained / 1e6:.2f}M trained parameters ({100 * trained / role.params:.2f} % of "
                     f"{role.params / 1e9:.2f}B){head}; gradients and optimizer state of these only")
    if cfg.reference_is_actor_base:
        actor, plan = roles["actor"], cfg.roles["actor"].plan
        ref = replace(actor, name="ref", trainable=False, lora=None)  # the model the base replaces
        saved = max(sum(b for _, b in mem.static_items(ref, plan, p)) for p in range(plan.P))
        lines.append(f"reference: the actor's base (adapters off), scored in the actor's slot: no reference model, "
                     f"{saved / GiB:.2f} GiB of weights saved per GPU against one in the actor's layout")
    return lines


def lever_lines(cfg, profile) -> List[str]:
    """Which memory levers are on, and the busiest rank's memory in every stage with them."""
    lv, ppo = cfg.levers, cfg.ppo
    mem, placement, roles, shadow = _memory_setup(cfg, profile)
    gen_plan = cfg.roles["actor"].gen_plan
    rows, b = mem.generation_rows(gen_plan), cfg.ppo.num_samples // gen_plan.D
    recompute = ("off" if lv.recompute_granularity is None else lv.recompute_granularity if
                 lv.recompute_granularity == "selective" else
                 f"full, {lv.recompute_method}, {lv.recompute_num_layers} layer(s)")
    budget = lv.inference_dynamic_batching_buffer_size_gb
    waves = -(-b // rows)
    kv = (f"{rows} of {b} sequences live per generation rank" + (f" ({budget:g} GiB KV budget)" if budget else "")
          + (f", {waves} waves" if waves > 1 else ""))
    lines = ["memory levers: recompute " + recompute
             + f"; offload during inference {'on' if lv.rl_offload_optimizer_during_inference else 'off'}"
             + "; log-probs a sequence chunk at a time where the logits exceed "
             + f"{LOGITS_CHUNK_BYTES >> 20} MiB of fp32; KV cache: {kv}"]
    by_stage: Dict[str, object] = {}
    for r in range(cfg.world_size):
        for rep in mem.stage_reports(r, placement, roles, shadow):
            if rep.stage not in by_stage or rep.total > by_stage[rep.stage].total:
                by_stage[rep.stage] = rep
    for stage, rep in by_stage.items():
        lines.append(f"  {stage:10s} " + rep.describe())
    return lines


def job_from_config(cfg, profile):
    from puzzle.plan_search.search import PPOJob

    shapes = shapes_from_config(cfg)
    critic = shapes.get("critic", shapes["actor"])  # a stand-in shape when the run has no critic
    return PPOJob(world_size=cfg.world_size, actor=shapes["actor"], critic=critic,
                  workload=workload_from_config(cfg), profile=profile, ref=shapes.get("ref"),
                  reward=shapes.get("reward") or critic, roles=tuple(cfg.roles), actor_lora=actor_lora(cfg),
                  critic_lora=actor_lora(cfg, "critic"),
                  reference_is_actor_base=cfg.reference_is_actor_base)


def lengths_from_config(cfg, metrics: Optional[str] = None):
    """The response-length distribution to price the long tail with: a run's metrics.jsonl
    (``metrics``), else --expected-response-length-p50/-p99, else every response at the cap."""
    from puzzle.plan_search.long_tail import ResponseLengths, from_metrics

    ppo = cfg.ppo
    if metrics:
        return from_metrics(metrics, ppo.max_new_tokens)
    if ppo.expected_response_length_p50 is None:
        return ResponseLengths("fixed", ppo.max_new_tokens)
    return ResponseLengths.from_percentiles(ppo.expected_response_length_p50, ppo.expected_response_length_p99,
                                            ppo.max_new_tokens)


def long_tail_report(cfg, profile, own_layouts: bool = False, plans=None, placements=None, lengths=None):
    """The long tail's three modes priced for the run (puzzle.plan_search.long_tail.compare_modes):
    the colocated ones at the run's own layouts (``own_layouts``, --dry-run: the overlap at a
    quarter, half and three quarters of the ranks for generation; a run with a generation pool
    of its own: the overlap at its layouts, the colocated modes searched), at ``plans`` /
    ``placements`` (a search's: the overlap at every split), else searched."""
    from puzzle.plan_search.long_tail import coarse_splits, compare_modes

    job = job_from_config(cfg, profile)
    job = replace(job, workload=replace(job.workload, mean_gen_len=None))
    pool = pool_layouts(cfg) if own_layouts else None
    if own_layouts and pool is None:
        plans, placements = _own_layouts(cfg)
    return compare_modes(job, lengths or lengths_from_config(cfg), cfg.ppo.n_samples_per_prompt,
                         cfg.ppo.rl_partial_rollouts_oversample, plans, placements,
                         gen_ranks=coarse_splits(cfg.world_size) if own_layouts else None,
                         partial_refused=partial_refused(cfg), overlap_layouts=pool)


def partial_refused(cfg) -> str:
    """Why the run could not take --rl-partial-rollouts (puzzle.flag_checks.check_partial_rollouts
    refuses these at start); empty when it could."""
    ppo = cfg.ppo
    if ppo.advantage_estimator == "remax":
        return "not with --advantage-estimator remax"
    if ppo.filter_groups:
        return "not with --filter-groups"
    if cfg.max_turns > 1:
        return "not with --max-turns > 1"
    return ""


def _planning_config(argv: List[str], world_size: int):
    from puzzle.arguments import build_parser, config_for_planning

    args = build_parser(prog="predict_mode", raise_errors=True).parse_args(
        list(argv) + ["--world-size", str(world_size)])
    return config_for_planning(args)


def _own_layouts(cfg):
    return placement_from_config(cfg), {"scoring": cfg.score_placement, "training": cfg.train_placement}


def pool_layouts(cfg):
    """(the training pool's plans, placements, the generation pool's plan) of a run with a
    generation pool of its own (--rl-desired-lag with --actor-gen-rank-offset), else None."""
    gen = cfg.roles["actor"].gen_plan
    if set(gen.ranks) & set(cfg.roles["actor"].plan.ranks):
        return None
    plans, placements = _own_layouts(cfg)
    plans["actor"] = {s: q for s, q in plans["actor"].items() if s != "generation"}
    return plans, placements, gen


def predict_modes(argvs: Dict[str, List[str]], lengths, world_size: int = 1,
                  profile: str = "cpu_long_tail_1rank", gen_ranks: Optional[List[int]] = None):
    """The long tail's three modes priced, each at the layouts of its own train_ppo.py flags
    (``argvs``: {'sync': ..., 'partial': ..., 'overlap': ...}; a mode left out: the sync flags'
    layouts, the overlap searched over ``gen_ranks`` generation ranks, None: every split) on
    ``world_size`` ranks under ``lengths`` (a
    puzzle.plan_search.long_tail.ResponseLengths) with ``profile`` (a bundled name or a file):
    the report (its ``choice``, each mode's seconds) puzzle.bench.long_tail prints beside its
    measurement. The overlap's flags need a generation pool of their own."""
    from puzzle.plan_search.long_tail import compare_modes

    cfg = _planning_config(argvs["sync"], world_size)
    job = job_from_config(cfg, load_profile(profile))
    partial = _planning_config(argvs["partial"], world_size) if "partial" in argvs else cfg
    overlap = None
    if "overlap" in argvs:
        overlap = pool_layouts(_planning_config(argvs["overlap"], world_size))
        if overlap is None:
            raise ValueError("predict_modes: the overlap's flags give no generation pool (--actor-gen-rank-offset)")
    return compare_modes(job, lengths, cfg.ppo.n_samples_per_prompt, partial.ppo.rl_partial_rollouts_oversample,
                         *_own_layouts(cfg), partial_refused=partial_refused(partial),
                         partial_layouts=_own_layouts(partial), overlap_layouts=overlap,
                         gen_ranks=gen_ranks)


def predict_mode(argv: List[str], lengths, world_size: int = 1, profile: str = "cpu_long_tail_1rank",
                 gen_ranks: Optional[List[int]] = None) -> str:
    """The long tail's advisory mode ('sync', 'partial' or 'overlap') for a run of train_ppo.py
    flags ``argv`` (its own layouts) on ``world_size`` ranks priced under ``lengths`` (a
    puzzle.plan_search.long_tail.ResponseLengths) with ``profile`` (a bundled name or a file), the
    overlap with ``gen_ranks`` generation ranks (None: every split); :func:`predict_modes` prices
    each mode at its own flags' layouts."""
    from puzzle.plan_search.long_tail import compare_modes

    cfg = _planning_config(argv, world_size)
    job = job_from_config(cfg, load_profile(profile))
    return compare_modes(job, lengths, cfg.ppo.n_samples_per_prompt, cfg.ppo.rl_partial_rollouts_oversample,
                         *_own_layouts(cfg), gen_ranks=gen_ranks, partial_refused=partial_refused(cfg)).choice


#: the levers the search may turn on: full recompute of every layer, offload during inference,
#: and fewer live sequences in generation (KV-cache rows per generation rank, waves of them)
RECOMPUTE_CHOICE = ("full", "uniform", 1)
GENERATION_ROWS = (64, 32, 16, 8)


def lever_workloads(w: PPOWorkload) -> List[PPOWorkload]:
    """The run's own levers first, then every combination with more of them on."""
    recompute = [(w.recompute_granularity, w.recompute_method, w.recompute_num_layers)]
    if w.recompute_granularity != "full":
        recompute.append(RECOMPUTE_CHOICE)
    rows = [w.generation_micro_batch_size] + [r for r in GENERATION_ROWS if w.generation_micro_batch_size is None
                                              or r < w.generation_micro_batch_size]
    out = []
    for rc in recompute:
        for offload in sorted({w.offload_during_inference, True}):
            for r in rows:
                out.append(replace(w, recompute_granularity=rc[0], recompute_method=rc[1], recompute_num_layers=rc[2],
                                   offload_during_inference=offload, generation_micro_batch_size=r))
    return out


def lever_flags(w: PPOWorkload, base: PPOWorkload) -> Dict[str, object]:
    """The flags that give a run the levers of ``w`` (those that differ from ``base``'s)."""
    flags: Dict[str, object] = {}
    if w.recompute_granularity != base.recompute_granularity:
        flags.update({"--recompute-granularity": w.recompute_granularity, "--recompute-method": w.recompute_method,
                      "--recompute-num-layers": w.recompute_num_layers})
    if w.offload_during_inference != base.offload_during_inference:
        flags["--rl-offload-optimizer-during-inference"] = True
    if w.generation_micro_batch_size != base.generation_micro_batch_size:
        flags["--generation-micro-batch-size"] = w.generation_micro_batch_size
    return flags


def search(cfg, profile, exhaustive: bool = False):
    """The fastest plan that fits, over the layouts and the memory levers (the run's own levers
    first; a lever set wins only when it is faster, so levers stay off where memory suffices).
    The result's ``levers`` are the flags that turn on what the run did not have."""
    from puzzle.plan_search.search import InfeasibleError, exhaustive_search, similarity_search

    job = job_from_config(cfg, profile)
    best, first_error = None, None
    for w in lever_workloads(job.workload):
        try:
            result = similarity_search(replace(job, workload=w))
        except InfeasibleError as e:
            first_error = first_error or e
            continue
        gen = result.plans["actor"]["generation"]
        if w.generation_micro_batch_size and (w.rollout_batch_size // gen.D) % w.generation_micro_batch_size:
            continue  # the generation micro-batch must divide the rank's samples
        if best is None or result.total_time < best[0].total_time:
            best = (result, w)
    if best is None:
        raise first_error
    result, w = best
    result.levers = lever_flags(w, job.workload)
    check = exhaustive_search(replace(job, workload=w)) if exhaustive else None
    return result, check


def lever_argv(levers: Dict[str, object]) -> List[str]:
    """Command-line form of a plan document's ``levers``."""
    out: List[str] = []
    for flag, value in levers.items():
        out += [flag] if value is True else [flag, str(value)]
    return out


SEARCH_USAGE = ("search_plan.py --world-size N [--ranks-per-node R] [--profile FILE|NAME] [--save-plan FILE] "
                "[--json] [--exhaustive] <the job's train_ppo.py flags>")
SEARCH_DESCRIPTION = """\
Search every model's layout (P, D, T[, E]) and each stage's placement for a job of --world-size
ranks (--ranks-per-node per node), from the job's own train_ppo.py flags (model shapes, batch
sizes, lengths, memory levers) and a device profile (--profile: the bundled a100_80gb, or the
JSON of python -m puzzle.tools.profile). The search's own options come first below, then the
flags it shares with train_ppo.py (--world-size, --ranks-per-node and --profile among them).

example: LLaMA-2-7B PPO on 2 nodes of 8 GPUs, the plan saved for train_ppo.py --plan-file
  python search_plan.py --world-size 16 --ranks-per-node 8 \\
      --num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32 \\
      --seq-length 2048 --max-position-embeddings 4096 --normalization RMSNorm --swiglu \\
      --untie-embeddings-and-output-weights --disable-bias-linear --vocab-size 32000 --bf16 \\
      --micro-batch-size 4 --global-batch-size 64 --rollout-batch-size 128 --max-new-tokens 512 \\
      --save-plan plan.json

The search prices the flags it is given: a run with memory levers (recompute, offload, a KV
budget) needs them here too. A launch script's plan, from all of its own flags, without GPUs:
  bash examples/run_ppo_7b.sh --dry-run --plan auto      (--plan auto: the run searches at start)"""


def _add_search_args(parser) -> None:
    g = parser.add_argument_group("plan search (this command's own options)")
    g.add_argument("--json", action="store_true", help="Print the result as JSON.")
    g.add_argument("--exhaustive", action="store_true", help="Also run the exhaustive search and report the gap.")
    g.add_argument("--save-plan", type=str, default=None, help="Write the plan file for train_ppo.py --plan-file.")
    g.add_argument("--response-lengths-from", type=str, default=None, metavar="METRICS_JSONL",
                   help="Price generation's long tail from the response lengths a run logged (its metrics.jsonl: "
                        "the median of its last 5 iterations' response_length_p10/p50/p90/max) instead of "
                        "--expected-response-length-p50/-p99.")


def search_main(argv: Optional[List[str]] = None) -> int:
    from puzzle.arguments import ArgumentError, build_parser, config_for_planning
    from puzzle.plan_search.search import InfeasibleError

    from puzzle.fail_fast import report_usage_error

    try:
        parser = build_parser(prog="search_plan.py", raise_errors=True, own_options=_add_search_args,
                              usage=SEARCH_USAGE, description=SEARCH_DESCRIPTION)
        args = parser.parse_args(argv)
        cfg = config_for_planning(args)
        profile = load_profile(args.profile or "a100_80gb")
        result, check = search(cfg, profile, exhaustive=args.exhaustive)
        tail = long_tail_report(cfg, profile, plans=result.plans, placements=result.placements,
                                lengths=lengths_from_config(cfg, args.response_lengths_from))
    except (ArgumentError, ValueError, OSError) as e:  # bad input: one line, exit 2 (as train_ppo.py)
        return report_usage_error(e)
    except InfeasibleError as e:
        print(f"error: no plan fits: {e}", file=sys.stderr)
        return 3
    doc = result.to_dict()
    if check is not None:
        doc["exhaustive_total_time"] = round(check.total_time, 6)
        doc["gap"] = round(result.total_time / check.total_time - 1.0, 6)
    doc["world_size"] = cfg.world_size
    doc["profile"] = profile.name
    doc["long_tail"] = tail.to_dict()
    if args.save_plan:
        with open(args.save_plan, "w") as f:
            json.dump(doc, f, indent=1)
    if args.json:
        print(json.dumps(doc))
        return 0
    print(f"plan for {cfg.world_size} ranks (profile {profile.name}, layout {doc['layout']}, "
          f"{doc['plans_evaluated']} plans evaluated in {doc['seconds']:.3f} s)")
    for model, stages in doc["plans"].items():
        print(f"  {model:7s} " + ", ".join(f"{s} {p}" for s, p in stages.items()))
    print("  placements: " + ", ".join(f"{s} {p}" for s, p in doc["placements"].items()))
    print("  estimated stage seconds: " + ", ".join(f"{k} {v:.3f}" for k, v in doc["stage_times"].items()))
    print(f"  switch: {doc['switch_bytes'] / 2**20:.1f} MiB on the busiest rank, {doc['switch_time']:.3f} s")
    print(f"  peak memory per device: {doc['peak_memory_gib']} GiB; iteration estimate {doc['total_time']:.3f} s")
    print("  memory levers: " + (" ".join(lever_argv(doc["levers"])) or "none needed"))
    if "gap" in doc:
        print(f"  exhaustive optimum {doc['exhaustive_total_time']:.3f} s (gap {100 * doc['gap']:.2f} %)")
    for line in tail.lines():
        print("  " + line)
    if args.save_plan:
        print(f"  plan written to {args.save_plan} (train_ppo.py --plan-file {args.save_plan})")
    return 0
