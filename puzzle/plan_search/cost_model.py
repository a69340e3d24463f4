"""Time estimates of PPO stages under (P, D, T) plans, from a :class:`Profile` (pure Python).

Stages of one PPO iteration (PUZZLE §4.3, Fig. 6): *generation* (actor, autoregressive),
*scoring* (forward passes: actor log-probs, ref, reward, critic values) and *training*
(actor and critic, ``ppo_epochs * ppo_minibatches`` optimizer steps).

* Training of one model: 1F1B pipeline, ``(N_B + P - 1) * (t_f + t_b)`` per optimizer step, where
  t_f / t_b are the per-micro-batch times of the slowest stage: profiled layer times x layers per
  stage + 2 tensor-parallel all-reduces of b*s*h bf16 per layer and direction + the LM head on
  the last stage + the pipeline send; then the data-parallel gradient reduce-scatter + parameter
  all-gather (distributed optimizer) and the Adam step (HBM bound).
* Scoring: forward only, ``(N_B + P - 1) * t_f``.
* Generation (puzzle/rollout/generation.py): prefills + ``gen_len - 1`` decode steps per cache
  wave with a static KV cache; a decode step of a layer is the profiled context-0 step time
  (bounded below by weight bytes / HBM / T) + the KV-cache read + 2 TP all-reduces. P = 1: one
  cache of ``generation_micro_batch_size`` rows, refilled as rows finish (continuous batching):
  ceil(b / rows) waves of one prefill of ``rows`` prompts and the decode steps at ``rows``.
  P > 1: hybrid inference scheduling: the replica's sequences (sorted by length: the prompts of
  a micro-batch are one length bucket) form micro-batches that flow through the stages. With
  ``cuda_graphs`` (GPU) a decode step of a layer is its weight bytes / HBM or its GEMM time,
  whichever is larger (no per-kernel launch cost), with attention over the cache's whole width,
  both over the profile's ``graph_decode_efficiency`` (the measured fraction of that bound a
  replayed step reaches).
* Time-sharing of several models with equal P on the same devices: PUZZLE Eq. (1), the sum of
  the models' pipelined work plus ONE bubble of the largest per-micro-batch stage time.
* Mixture-of-experts models (puzzle.plan_search.experts): layer times of the active width (topk
  experts), plus per MoE layer the dispatcher's dispatch + combine forward and again backward over
  the expert group's link, the expert-data-parallel gradient sync and Adam step of the rank's
  expert shard, and per decode step the bytes of the experts the batch touches. Training at
  T > 1 splits each MoE layer's tokens over T (its dispatchers move the rank's share; an
  all-gather over T replaces the MLP's all-reduce; the routers' gradients are summed over T);
  forward-only passes at T > 1 compute every token's experts on every TP rank (the experts'
  FLOPs beyond the T-split share are added, the MLP's all-reduce is dropped).
* Switching the actor from its training to its generation plan: :func:`switch_bytes_per_rank`
  (the exact lower bound: destination-layout bytes a rank does not already hold) over the
  intra-/inter-node bandwidth; a LoRA actor's switch moves its adapters only (its base stays laid
  out on the generation ranks after the first).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from puzzle.config import ROLES
from puzzle.model_shape import ModelShape, layer_params, lora_expert_layer_params, lora_layer_params, moe_fraction
from puzzle.parallel.plan import ParallelPlan, PlanError
from puzzle.parallel.streams import stream_problem
from puzzle.plan_search import experts
from puzzle.plan_search.profile_data import Profile

BF16 = 2  # bytes per bf16 value


# ---- model / workload descriptions -------------------------------------------------------------
#: PUZZLE Table 1 (LLaMA, 32000 vocab, MHA) + LLaMA-2-70B (GQA with 8 groups).
LLAMA_SHAPES: Dict[str, ModelShape] = {
    "350M": ModelShape(16, 512, 11008, 8, 8, 32000),
    "7B": ModelShape(32, 4096, 11008, 32, 32, 32000),
    "13B": ModelShape(40, 5120, 13824, 40, 40, 32000),
    "33B": ModelShape(64, 6656, 17920, 52, 52, 32000),
    "70B": ModelShape(80, 8192, 28672, 64, 8, 32000),
}


@dataclass(frozen=True)
class ModelRole:
    """One of the four PPO models. ``lm_head``: vocabulary head (actor, ref) vs scalar value
    head (critic, reward). ``lora`` (dim, target modules): a trainable model whose base is frozen
    and whose rank-dim adapters train (gradients and optimizer state of the adapters only)."""

    name: str
    shape: ModelShape
    trainable: bool
    lm_head: bool
    lora: Optional[Tuple[int, Tuple[str, ...]]] = None

    @property
    def params(self) -> int:
        return self.shape.param_count(self.lm_head)


def ppo_roles(actor: ModelShape, critic: Optional[ModelShape], ref: Optional[ModelShape] = None,
              reward: Optional[ModelShape] = None, actor_lora=None, critic_lora=None) -> Dict[str, ModelRole]:
    """actor/critic/ref/reward; ref mirrors the actor and reward the critic (else the actor) unless
    given. ``critic=None``: a run without a critic (critic-free estimators), no critic role.
    ``actor_lora`` (dim, target modules): the actor trains LoRA adapters on a frozen base;
    ``critic_lora``: the critic too (its value head trained whole)."""
    shapes = {"actor": actor, "ref": ref or actor, "reward": reward or critic or actor, "critic": critic}
    return {name: ModelRole(name, shape, ROLES[name].trainable, ROLES[name].lm_head,
                            lora={"actor": actor_lora, "critic": critic_lora}.get(name))
            for name, shape in shapes.items() if shape is not None}


@dataclass(frozen=True)
class PPOWorkload:
    """One PPO iteration. ``rollout_batch_size`` prompts generate ``gen_len`` tokens each; training
    and scoring run on ``prompt_len + gen_len`` tokens per sample."""

    rollout_batch_size: int
    prompt_len: int = 256
    gen_len: int = 256
    micro_batch_size: int = 4
    ppo_epochs: int = 1
    ppo_minibatches: int = 1
    score_micro_batch_size: Optional[int] = None  # None: micro_batch_size
    distributed_optimizer: bool = True
    actor_logprobs_in_scoring: bool = True  # recompute the old log-probs in the scoring stage
    generation_micro_batch_size: Optional[int] = None  # KV-cache rows per DP rank (None: all)
    cuda_graphs: bool = False  # decode steps replayed from CUDA graphs (GPU)
    # memory levers (puzzle.memory_levers.MemoryLevers): activation recompute in training, and the
    # trainable roles' gradients + optimizer states (frozen roles' weights) on the host while
    # they are idle (--rl-offload-optimizer-during-inference)
    recompute_granularity: Optional[str] = None
    recompute_method: Optional[str] = None
    recompute_num_layers: Optional[int] = None
    offload_during_inference: bool = False
    # micro-batches priced by their tokens: ``mean_gen_len`` response tokens on average (None: every
    # response at ``gen_len``); ``packed`` sequences without padding (else rows padded to seq_len);
    # token budgets per training / scoring micro-batch (--use-dynamic-bsz; None: micro_batch_size rows)
    mean_gen_len: Optional[float] = None
    packed: bool = True
    train_token_budget: Optional[int] = None
    score_token_budget: Optional[int] = None

    def __post_init__(self):
        for k in ("rollout_batch_size", "prompt_len", "gen_len", "micro_batch_size", "ppo_epochs", "ppo_minibatches"):
            v = getattr(self, k)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"PPOWorkload.{k} must be a positive integer, got {v!r}")
        if self.rollout_batch_size % self.ppo_minibatches:
            raise ValueError(f"rollout_batch_size={self.rollout_batch_size} is not divisible by "
                             f"ppo_minibatches={self.ppo_minibatches}")

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.gen_len

    @property
    def score_mbs(self) -> int:
        return self.score_micro_batch_size or self.micro_batch_size

    @property
    def mean_seq_len(self) -> float:
        """Mean tokens of a sequence (prompt + mean response)."""
        return self.prompt_len + (self.gen_len if self.mean_gen_len is None else self.mean_gen_len)

    def micro_batches(self, samples: int, stage: str) -> Tuple[int, float, float]:
        """(micro-batches, mean tokens of one, most tokens of one) of one DP rank's ``samples``
        rows in ``stage`` ('training' or 'scoring'): ``micro_batch_size`` rows each, their tokens
        the rows' mean (packed) or seq_len each (padded); with a token budget as many rows as fill
        it (one micro-batch per budget of tokens, at most one per row)."""
        budget = self.train_token_budget if stage == "training" else self.score_token_budget
        if budget is not None:
            n = min(max(1, math.ceil(samples * self.mean_seq_len / budget)), samples)
            return n, samples * self.mean_seq_len / n, float(budget)
        mb = min(self.micro_batch_size if stage == "training" else self.score_mbs, samples)
        seq = self.mean_seq_len if self.packed else float(self.seq_len)
        return math.ceil(samples / mb), mb * seq, float(mb * self.seq_len)

    @property
    def optimizer_steps(self) -> int:
        return self.ppo_epochs * self.ppo_minibatches

    def max_dp(self, stage: str) -> int:
        """Largest D that still gives every data-parallel replica at least one sample."""
        return self.rollout_batch_size // self.ppo_minibatches if stage == "training" else self.rollout_batch_size


def plan_problems(shape: ModelShape, plan: ParallelPlan, workload: PPOWorkload, stage: str,
                  ranks_per_node: int) -> List[str]:
    """Why ``plan`` cannot run ``stage`` of this model (empty list: it can)."""
    out = []
    try:
        shape.check_plan(plan)
    except PlanError as e:
        out.append(str(e).split(": ", 1)[-1])
    if plan.T > ranks_per_node:
        out.append(f"T={plan.T} > {ranks_per_node} ranks per node")
    if plan.D > workload.max_dp(stage):
        out.append(f"D={plan.D} > {workload.max_dp(stage)} samples per {stage} batch")
    if shape.is_moe and stage == "generation" and plan.D % experts.token_sets(plan.E, plan.ETP, plan.T):
        out.append(f"E*ETP/T={plan.E * plan.ETP // plan.T} must divide D={plan.D} for generation")
    if stage == "generation" and workload.cuda_graphs:  # what --cuda-graph-generation runs
        if plan.P > 1:
            out.append(f"P={plan.P}: CUDA-graph generation needs P=1")
        if shape.is_moe and (plan.E > 1 or plan.ETP > 1):
            out.append(f"E={plan.E}, ETP={plan.ETP}: CUDA-graph generation of a MoE model needs every expert "
                       "whole on each rank (E=1, ETP=1)")
    return out


# ---- helpers ----------------------------------------------------------------------------------------
def _crosses_node(first: int, stride: int, count: int, rpn: int) -> bool:
    return count > 1 and first // rpn != (first + stride * (count - 1)) // rpn


def _group_links(plan: ParallelPlan, rpn: int) -> Tuple[bool, bool, bool]:
    """(TP group crosses a node, DP group crosses a node, a pipeline hop crosses a node)."""
    P, D, T = plan.P, plan.D, plan.T
    tp = any(_crosses_node(plan.rank(p, d, 0), 1, T, rpn) for p in range(P) for d in range(D))
    dp = any(_crosses_node(plan.rank(p, 0, t), T, D, rpn) for p in range(P) for t in range(T))
    pp = any(plan.rank(p, d, t) // rpn != plan.rank(p + 1, d, t) // rpn
             for p in range(P - 1) for d in range(D) for t in range(T))
    return tp, dp, pp


def expert_params_on_rank(role: ModelRole, plan: ParallelPlan) -> float:
    """Expert parameters one rank of ``plan`` holds (0 for a dense model)."""
    return experts.expert_params_on_rank(role.shape, plan.P, plan.E, plan.ETP)


def params_on_stage(role: ModelRole, P: int, T: int, p: int) -> float:
    """Parameters one rank of pipeline stage p holds under degrees (P, T), experts apart
    (:func:`expert_params_on_rank`)."""
    s = role.shape
    n = s.num_layers // P * (s.layer_split_params / T + s.layer_replicated_params)
    if p == 0:
        n += s.vocab_size * s.hidden_size / T
    if p == P - 1:
        n += s.hidden_size + (s.vocab_size * s.hidden_size / T if role.lm_head else s.hidden_size)
    return n


def trained_params_on_stage(role: ModelRole, P: int, T: int, p: int) -> float:
    """Parameters with gradients and optimizer state on one rank of stage p: the whole shard
    (:func:`params_on_stage`), or a LoRA model's adapters only."""
    if role.lora is None:
        return params_on_stage(role, P, T, p)
    split, replicated = lora_layer_params(role.shape, *role.lora)
    head = role.shape.hidden_size if p == P - 1 and not role.lm_head else 0  # a critic's value head: trained whole
    return role.shape.num_layers // P * (split / T + replicated) + head


def trained_expert_params_on_rank(role: ModelRole, plan: ParallelPlan) -> float:
    """Expert parameters with gradients on one rank; under LoRA the experts' adapters (split over E,
    and their split factor over ETP; the experts themselves are frozen)."""
    if role.lora is None:
        return expert_params_on_rank(role, plan)
    split, replicated = lora_expert_layer_params(role.shape, *role.lora)
    return role.shape.num_layers / plan.P * (split / plan.ETP + replicated) / plan.E


@dataclass(frozen=True)
class TaskCost:
    """Estimated time of one model's work in one stage. For pipelined work (training, scoring):
    ``repeats`` pipeline flushes of ``n_micro`` micro-batches at ``t_stage`` seconds per
    micro-batch on the slowest stage, plus ``extra`` non-pipelined seconds per repeat (data-
    parallel gradient sync + optimizer step). For generation: ``n_micro`` decode micro-batches,
    ``t_stage`` one decode step of one stage, ``extra`` the prefill time."""

    model: str
    kind: str
    plan: ParallelPlan
    n_micro: int
    t_stage: float
    extra: float
    repeats: int
    total: float

    @property
    def work(self) -> float:
        """Pipelined busy time without bubbles (a lower bound of any schedule of this task)."""
        return self.repeats * (self.n_micro * self.t_stage + self.extra) if self.kind != "generate" else self.total


def pipeline_time(n_micro: int, P: int, t_stage: float) -> float:
    """1F1B / GPipe flush time: (N_B + P - 1) * t."""
    return (n_micro + P - 1) * t_stage


def sequential_time(tasks: Sequence[TaskCost]) -> float:
    return sum(t.total for t in tasks)


def time_sharing_time(tasks: Sequence[TaskCost]) -> float:
    """PUZZLE Eq. (1): models with equal P time-share the same devices; the pipelines interleave
    so only one warm-up/cool-down of the largest per-micro-batch time remains:
    ``repeats * (sum_k N_B,k * t_k + (P - 1) * max_k t_k + sum_k extra_k)``."""
    if not tasks:
        return 0.0
    P, reps = tasks[0].plan.P, tasks[0].repeats
    if any(t.plan.P != P or t.repeats != reps for t in tasks) or any(t.kind == "generate" for t in tasks):
        raise ValueError("time-sharing needs pipelined tasks with equal P and equal repeats")
    if len(tasks) == 1:
        return tasks[0].total
    return reps * (sum(t.n_micro * t.t_stage + t.extra for t in tasks) + (P - 1) * max(t.t_stage for t in tasks))


def grouped_time(tasks: Sequence[TaskCost]) -> Tuple[float, bool]:
    """Tasks on the same devices: Eq. (1) within each set of equal P, sets one after another.
    Returns (time, whether any time-sharing saved time)."""
    groups: Dict[Tuple[int, int], List[TaskCost]] = {}
    for t in tasks:
        groups.setdefault((t.plan.P, t.repeats), []).append(t)
    total, shared = 0.0, False
    for (P, _), g in groups.items():
        total += time_sharing_time(g)
        shared = shared or (len(g) > 1 and P > 1)
    return total, shared


def colocated_time(tasks: Sequence[TaskCost]) -> Tuple[float, bool]:
    """Tasks of one stage on the same ranks under 'time-sharing', as the trainer runs them: one
    interleaved stream (Eq. (1), :func:`grouped_time`) when their plans may share one
    (puzzle.parallel.streams.stream_problem: equal P, any (D, T); one plan where experts are
    split), else one after another -- validate_args refuses time-sharing of the others. Returns
    (time, whether time-sharing saved time)."""
    if stream_problem([t.plan for t in tasks]) is not None:
        return sequential_time(tasks), False
    return grouped_time(tasks)


def stage_time(tasks: Sequence[TaskCost], placement: str) -> float:
    """Seconds of one stage's models as puzzle.pipeline.run_stage runs them: models on the same
    ranks one after another (one Eq. (1) stream when ``placement`` is 'time-sharing' and their
    plans may share one, :func:`colocated_time`); groups on disjoint ranks concurrently (any
    placement); partly overlapping groups add up."""
    groups: Dict[Tuple[int, int], List[TaskCost]] = {}
    for t in tasks:
        groups.setdefault((t.plan.offset, t.plan.size), []).append(t)
    times = [colocated_time(g)[0] if placement == "time-sharing" else sequential_time(g)
             for g in groups.values()]
    spans = [set(range(o, o + n)) for o, n in groups]
    disjoint = all(not (a & b) for i, a in enumerate(spans) for b in spans[i + 1:])
    return max(times) if disjoint else sum(times)


def stage_seconds(cm: "CostModel", roles: Dict[str, "ModelRole"],
                  plans: Dict[str, Dict[str, ParallelPlan]], placements: Dict[str, str],
                  reference_is_actor_base: bool = False) -> Dict[str, float]:
    """Estimated seconds of PPOTrainer's three stages, with the boundaries of its ``time_*``
    metrics: the actor's train->generation switch overlaps its last optimizer step, so it counts in
    training. ``plans[model][stage]``: the models present take part (no 'reward' entry = a reward
    function). ``reference_is_actor_base``: a LoRA actor's reference is a second forward of the
    actor (adapters off) in its scoring plan, no model of its own."""
    A = plans["actor"]["training"]
    G = plans["actor"].get("generation", A)
    score = [cm.forward_cost(roles[m], st["scoring"]) for m, st in plans.items() if "scoring" in st]
    if reference_is_actor_base:
        score.append(cm.forward_cost(roles["actor"], plans["actor"]["scoring"]))
    train = [cm.train_cost(roles[m], st["training"]) for m, st in plans.items() if "training" in st]
    return {"generation": cm.generation_cost(roles["actor"], G).total,
            "scoring": stage_time(score, placements.get("scoring", "sequential")),
            "training": stage_time(train, placements.get("training", "sequential"))
            + cm.switch(roles["actor"], A, G)[1]
            # offloaded state goes out and comes back once per iteration (every model in turn)
            + sum(cm.offload_cost(roles[m], st.get("training") or st["scoring"]) for m, st in plans.items())}


# ---- switching (exact lower bound of the bytes a rank must receive) ------------------------------
def switch_bytes_per_rank(shape: ModelShape, src: ParallelPlan, dst: ParallelPlan, *, lm_head: bool = True,
                          ranks_per_node: Optional[int] = None, dtype_bytes: int = BF16,
                          adapters_of: Optional[Tuple[int, Tuple[str, ...]]] = None) -> Dict[int, Tuple[int, int]]:
    """For every rank of ``dst``: (intra-node, inter-node) bytes of its destination shard that it
    does not already hold in the ``src`` layout. A missing piece counts as intra-node when some
    src replica holding it lives on the receiver's node (``ranks_per_node`` None: all intra).

    Shards are boxes of (layer range of the pipeline stage) x (TP fraction [t/T, (t+1)/T)) of
    the split weights; RMSNorm weights, the final norm and a value head are replicated over TP;
    the embedding (stage 0) and the LM head (last stage) are vocabulary-split. This is the
    lower bound any routing table (puzzle.switch.routing) must move; it can later delegate.
    A MoE model's experts add what :func:`experts.switch_bytes` counts (the split parameters
    above are then the attention's and the dense MLPs', the router replicated).

    ``adapters_of`` (dim, target modules): only a LoRA actor's adapters move (its frozen base is
    already laid out on the generation ranks, puzzle/switch/lora_merge.py): per layer the
    adapters' T-split and T-replicated parameters (puzzle.model_shape.lora_layer_params), no
    embedding nor head; the experts' adapters move with their experts."""
    shape.check_plan(src, "switch source")
    shape.check_plan(dst, "switch destination")
    L = shape.num_layers
    S, R, E, H_split, H_repl, F, per_expert = _switched_params(shape, lm_head, adapters_of)
    rpn = ranks_per_node or (1 << 62)
    Ls, Ld = L // src.P, L // dst.P
    Ps, Ds, Ts, Pd, Dd, Td = src.P, src.D, src.T, dst.P, dst.D, dst.T
    out: Dict[int, Tuple[int, int]] = {}
    memo: Dict[tuple, Tuple[int, int]] = {}
    for pd in range(Pd):
        a, b = pd * Ld, (pd + 1) * Ld
        stages = range(a // Ls, (b - 1) // Ls + 1)
        for td in range(Td):
            f0, f1 = td / Td, (td + 1) / Td
            ts0, ts1 = int(f0 * Ts + 1e-9), int(math.ceil(f1 * Ts - 1e-9))
            for dd in range(Dd):
                r = dst.offset + (pd * Dd + dd) * Td + td
                rs = r - src.offset
                own = (rs // (Ds * Ts), rs % Ts) if 0 <= rs < src.size else None
                key = (pd, td, own, r // rpn)
                if key in memo:
                    out[r] = memo[key]
                    continue
                own_last = own is not None and own[0] == Ps - 1
                intra = inter = 0.0
                node_lo = (r // rpn) * rpn
                for ps in stages:
                    n = min(b, (ps + 1) * Ls) - max(a, ps * Ls)
                    n_new = 0 if own is not None and own[0] == ps else n  # own stage: its norms are held
                    both_first = ps == 0 and pd == 0
                    both_last = ps == Ps - 1 and pd == Pd - 1
                    for ts in range(ts0, ts1):
                        if own == (ps, ts):
                            continue
                        fr = min(f1, (ts + 1) / Ts) - max(f0, ts / Ts)
                        nbytes = n * S * fr + (E * fr if both_first else 0) + (H_split * fr if both_last else 0)
                        if ts == ts0:  # replicated parts come from the first overlapping TP box
                            nbytes += n_new * R + ((H_repl + F) if both_last and not own_last else 0)
                        if ranks_per_node is None:
                            intra += nbytes
                            continue
                        first = src.offset + ps * Ds * Ts + ts  # holders: first + d*T_src, d < D_src
                        lo = max(0, -((first - node_lo) // Ts))
                        hi = min(Ds - 1, (node_lo + rpn - 1 - first) // Ts)
                        if lo <= hi:
                            intra += nbytes
                        else:
                            inter += nbytes
                memo[key] = out[r] = (int(round(intra * dtype_bytes)), int(round(inter * dtype_bytes)))
    for r, (intra, inter) in experts.switch_bytes(shape, src, dst, ranks_per_node, dtype_bytes, *per_expert).items():
        out[r] = (out[r][0] + int(round(intra)), out[r][1] + int(round(inter)))
    return dict(sorted(out.items()))


def _switched_params(shape: ModelShape, lm_head: bool, adapters_of):
    """What a switch moves, in parameters: per layer (T-split, T-replicated), the embedding, the
    head's vocabulary-split and replicated parts, the final norm, and the per-expert pair (split
    over ETP, whole on each ETP rank; (None, 0.0): the experts' own MLPs). A LoRA actor's
    ``adapters_of`` (dim, target modules): its adapters only."""
    if adapters_of is None:
        E = shape.vocab_size * shape.hidden_size
        return (shape.layer_split_params, shape.layer_replicated_params, E, E if lm_head else 0,
                0 if lm_head else shape.hidden_size, shape.hidden_size, (None, 0.0))
    S, R = lora_layer_params(shape, *adapters_of)
    per_expert = (None, 0.0)
    if shape.num_experts:
        experts_per_layer = moe_fraction(shape) * shape.num_experts
        per_expert = tuple(x / experts_per_layer for x in lora_expert_layer_params(shape, *adapters_of))
    return S, R, 0, 0, 0, 0, per_expert


def switch_bytes_max_rank(shape: ModelShape, src: ParallelPlan, dst: ParallelPlan, *, lm_head: bool = True) -> int:
    """Largest number of bytes any destination rank lacks when switching ``src`` -> ``dst``."""
    per = switch_bytes_per_rank(shape, src, dst, lm_head=lm_head)
    return max((a + b for a, b in per.values()), default=0)


# ---- the cost model ---------------------------------------------------------------------------
class CostModel:
    """Stage-time estimates of PPO models under plans; results are cached per (role, plan)."""

    def __init__(self, profile: Profile, workload: PPOWorkload):
        self.profile, self.workload = profile, workload
        self._cache: Dict[tuple, object] = {}

    def _links(self, plan: ParallelPlan):
        key = ("links", plan)
        if key not in self._cache:
            self._cache[key] = _group_links(plan, self.profile.ranks_per_node)
        return self._cache[key]

    def _expert_link(self, plan: ParallelPlan) -> bool:
        """Whether an expert-parallel group of ``plan`` spans two nodes."""
        key = ("ep_link", plan)
        if key not in self._cache:
            rpn = self.profile.ranks_per_node
            self._cache[key] = any(g[0] // rpn != g[-1] // rpn for g in plan.ep_groups()) if plan.E > 1 else False
        return self._cache[key]

    def _moe_comm(self, role: ModelRole, tokens: float, plan: ParallelPlan, split: bool = False) -> float:
        """Dispatcher seconds of an average layer's forward (dispatch + combine of a MoE layer,
        weighted by the share of MoE layers); the backward moves as much again. 0 when dense.
        ``split``: the MoE layers split the micro-batch's ``tokens`` over T (training)."""
        s = role.shape
        if not s.is_moe:
            return 0.0
        one = experts.dispatch_seconds(self.profile, s, tokens, plan.E, plan.ETP, plan.T, self._expert_link(plan),
                                       split and plan.T > 1)
        return 2.0 * experts.moe_fraction(s) * one

    def _tp_comm(self, role: ModelRole, tokens: float, plan: ParallelPlan, inter: bool, split: bool = False) -> float:
        """Tensor-parallel collectives of an average layer in one direction: the attention's and a
        dense MLP's all-reduces of the micro-batch's bf16 hidden states. A MoE layer's MLP has no
        all-reduce: it all-gathers its output over T when it splits the tokens (``split``,
        training), and needs nothing when every TP rank computes all of them (forward-only)."""
        s, prof = role.shape, self.profile
        ar = prof.allreduce_time(tokens * s.hidden_size * BF16, plan.T, inter)
        if not s.is_moe:
            return 2 * ar
        m = experts.moe_fraction(s)
        gather = experts.split_gather_seconds(prof, s, tokens, plan.T, inter) if split else 0.0
        return ar + (1.0 - m) * ar + m * gather

    def _unsplit_experts(self, role: ModelRole, tokens: float, plan: ParallelPlan) -> float:
        """Forward seconds an average MoE layer adds to the layer table's T-split active width when
        every TP rank computes all of its tokens' experts (forward-only passes at T > 1)."""
        return self.profile.gemm_time(experts.unsplit_expert_flops(role.shape, tokens, plan.T))

    def _expert_sync(self, role: ModelRole, plan: ParallelPlan, inter: bool) -> float:
        """Expert-data-parallel gradient sync of the rank's expert shard (reduce-scatter fp32 grads
        + all-gather bf16 params with the distributed optimizer, else an all-reduce)."""
        phe = expert_params_on_rank(role, plan)
        n = plan.EDP
        if phe <= 0 or n <= 1:
            return 0.0
        prof = self.profile
        if self.workload.distributed_optimizer:
            return (n - 1) / n * 6.0 * phe / prof.bandwidth(inter) + 2 * prof.allreduce_latency(n, inter)
        return prof.allreduce_time(4.0 * phe, n, inter)

    def _router_grad_sum(self, role: ModelRole, plan: ParallelPlan, inter: bool) -> float:
        """All-reduce over T of the routers' fp32 partial gradients of a stage (MoE layers that
        split their tokens over T: each TP rank's router saw its share)."""
        s = role.shape
        if not s.is_moe or plan.T <= 1:
            return 0.0
        router = s.n_moe_layers / plan.P * s.num_experts * s.hidden_size
        return self.profile.allreduce_time(4.0 * router, plan.T, inter)

    def _p2p(self, nbytes: float, P: int, inter: bool) -> float:
        return 0.0 if P == 1 else nbytes / self.profile.bandwidth(inter) + self.profile.latency(inter)

    def _head_fwd(self, role: ModelRole, tokens: float, T: int) -> float:
        h, V = role.shape.hidden_size, role.shape.vocab_size
        if not role.lm_head:
            return 0.0
        # logits GEMM + fp32 softmax/log-prob passes over the logits (3 reads/writes)
        return self.profile.gemm_time(2.0 * tokens * h * V / T) + self.profile.hbm_time(3 * 4.0 * tokens * V / T)

    # -- training ---------------------------------------------------------------------
    def train_cost(self, role: ModelRole, plan: ParallelPlan) -> TaskCost:
        key = ("train", role, plan)
        if key in self._cache:
            return self._cache[key]
        w, prof, s = self.workload, self.profile, role.shape
        P, D, T = plan.P, plan.D, plan.T
        tp_x, dp_x, pp_x = self._links(plan)
        samples = math.ceil(w.rollout_batch_size / w.ppo_minibatches / D)
        n_micro, tokens, _ = w.micro_batches(samples, "training")
        tab = prof.layer_table(s.compute_shape)
        # MoE layers split their tokens over T in training; their dispatchers' all-to-alls
        ar_moe = self._tp_comm(role, tokens, plan, tp_x, split=True) + self._moe_comm(role, tokens, plan, split=True)
        layers = s.num_layers // P
        p2p = self._p2p(tokens * s.hidden_size * BF16, P, pp_x)
        head_f = self._head_fwd(role, tokens, T)
        t_f = layers * (tab.fwd(tokens, T) + ar_moe) + head_f + p2p
        if role.lora is None:
            t_b = layers * (tab.bwd(tokens, T) + ar_moe) + 2 * head_f + p2p
        else:  # a frozen base computes its input gradients only (no weight gradients): ~ a forward
            t_b = layers * (tab.fwd(tokens, T) + ar_moe) + head_f + p2p
        if w.recompute_granularity == "full":  # the recomputed layers run their forward again
            redo = layers if w.recompute_method == "uniform" else min(w.recompute_num_layers, layers)
            t_b += redo * (tab.fwd(tokens, T) + ar_moe)
        phi = max(trained_params_on_stage(role, P, T, 0), trained_params_on_stage(role, P, T, P - 1))
        phe = trained_expert_params_on_rank(role, plan)
        if D > 1:
            if w.distributed_optimizer:  # reduce-scatter fp32 grads + all-gather bf16 params
                dp = (D - 1) / D * 6.0 * phi / prof.bandwidth(dp_x) + 2 * prof.allreduce_latency(D, dp_x)
            else:
                dp = prof.allreduce_time(4.0 * phi, D, dp_x)
        else:
            dp = 0.0
        dp += self._expert_sync(role, plan, dp_x) + self._router_grad_sum(role, plan, tp_x)
        opt = prof.hbm_time(36.0 * phi / (D if w.distributed_optimizer else 1)  # Adam: ~36 B/param moved
                            + 36.0 * phe / (plan.EDP if w.distributed_optimizer else 1))
        reps = w.optimizer_steps
        t = t_f + t_b
        total = reps * (pipeline_time(n_micro, P, t) + dp + opt)
        cost = TaskCost(role.name, "train", plan, n_micro, t, dp + opt, reps, total)
        self._cache[key] = cost
        return cost

    # -- scoring (forward only) -------------------------------------------------------
    def forward_cost(self, role: ModelRole, plan: ParallelPlan) -> TaskCost:
        key = ("fwd", role, plan)
        if key in self._cache:
            return self._cache[key]
        w, prof, s = self.workload, self.profile, role.shape
        P, D, T = plan.P, plan.D, plan.T
        tp_x, _, pp_x = self._links(plan)
        samples = math.ceil(w.rollout_batch_size / D)
        n_micro, tokens, _ = w.micro_batches(samples, "scoring")
        tab = prof.layer_table(s.compute_shape)
        ar = self._tp_comm(role, tokens, plan, tp_x) + self._moe_comm(role, tokens, plan)
        t = (s.num_layers // P * (tab.fwd(tokens, T) + self._unsplit_experts(role, tokens, plan) + ar)
             + self._head_fwd(role, tokens, T)
             + self._p2p(tokens * s.hidden_size * BF16, P, pp_x))
        cost = TaskCost(role.name, "forward", plan, n_micro, t, 0.0, 1, pipeline_time(n_micro, P, t))
        self._cache[key] = cost
        return cost

    # -- offload between stages (--rl-offload-optimizer-during-inference) ----------------------
    def offload_cost(self, role: ModelRole, plan: ParallelPlan) -> float:
        """Seconds of one iteration's host round trip of ``role``'s offloaded state on its busiest
        stage: optimizer states (trainable) or bf16 weights (frozen), out and back over the host
        link (gradients are freed and re-zeroed, not copied)."""
        if not self.workload.offload_during_inference:
            return 0.0
        if role.trainable:
            phi = max(trained_params_on_stage(role, plan.P, plan.T, p) for p in range(plan.P))
            phe = trained_expert_params_on_rank(role, plan)
        else:
            phi = max(params_on_stage(role, plan.P, plan.T, p) for p in range(plan.P))
            phe = expert_params_on_rank(role, plan)
        dist = self.workload.distributed_optimizer
        nbytes = (12.0 * phi / (plan.D if dist else 1) + 12.0 * phe / (plan.EDP if dist else 1) if role.trainable
                  else BF16 * (phi + phe))
        return 2.0 * nbytes / self.profile.host_link_bandwidth

    # -- generation -----------------------------------------------------------------------
    def generation_cost(self, role: ModelRole, plan: ParallelPlan) -> TaskCost:
        """Prefill + decode of the generation loop (see the module docstring). P > 1: the
        replica's b sequences form m micro-batches (default min(P, b)); a decode step takes
        max(m, P) stage times (the pipeline is full when m = P, latency-bound when b < P)."""
        key = ("gen", role, plan)
        if key in self._cache:
            return self._cache[key]
        w, P = self.workload, plan.P
        b = math.ceil(w.rollout_batch_size / plan.D)
        rows = min(w.generation_micro_batch_size or b, b)
        steps = w.gen_len - 1  # the first token comes from the prefill
        if P == 1:  # one cache of `rows` rows, refilled: waves of prefill + decode steps
            waves = math.ceil(b / rows)
            m, bm = 1, rows
            prefill = waves * self.prefill_seconds(role, plan, rows, rows * w.prompt_len)
        else:
            waves = 1
            m = math.ceil(b / w.generation_micro_batch_size) if w.generation_micro_batch_size else min(P, b)
            bm = math.ceil(b / m)
            prefill = self._pipelined_prefill(role, plan, b, m)
        t_dec, token_return = self._decode_step(role, plan, bm)
        # the host's share of a decode step (planning, sampling, state update: the profile's
        # decode step overhead at T, per model call) is paid by every micro-batch a stage serves
        decode = waves * steps * (max(m, P) * (t_dec + self.profile.decode_step_overhead(plan.T)) + token_return)
        cost = TaskCost(role.name, "generate", plan, m, t_dec, prefill, 1, prefill + decode)
        self._cache[key] = cost
        return cost

    def decode_step_seconds(self, role: ModelRole, plan: ParallelPlan, rows: int) -> float:
        """One decode step of a P = 1 replica computing ``rows`` cache rows (the
        long tail's unit price, puzzle.plan_search.long_tail): the step of :meth:`generation_cost`
        at that many rows, with the host's share of the step."""
        if plan.P != 1:
            raise ValueError(f"decode_step_seconds prices P=1 plans (got P={plan.P})")
        key = ("step", role, plan, rows)
        if key not in self._cache:
            t_dec, _ = self._decode_step(role, plan, rows)
            self._cache[key] = t_dec + self.profile.decode_step_overhead(plan.T)
        return self._cache[key]

    def prefill_seconds(self, role: ModelRole, plan: ParallelPlan, rows: int, tokens: float) -> float:
        """One P = 1 prefill of ``rows`` sequences of ``tokens`` tokens in all (prompts, or
        prompt + partial response when a carried sample resumes)."""
        s = role.shape
        tp_x, _, _ = self._links(plan)
        tab = self.profile.layer_table(s.compute_shape)
        layers = s.num_layers // plan.P
        return (layers * (tab.fwd(tokens, plan.T) + self._unsplit_experts(role, tokens, plan)
                          + self._tp_comm(role, tokens, plan, tp_x) + self._moe_comm(role, tokens, plan))
                + self._head_fwd(role, rows, plan.T))

    def _decode_step(self, role: ModelRole, plan: ParallelPlan, bm: int) -> Tuple[float, float]:
        """(one decode step of one pipeline stage at ``bm`` rows, the sampled tokens' hop back
        to the first stage): weights (profiled step at context 0) + KV-cache read at the mean
        context length + TP collectives + head + sampling."""
        w, prof, s = self.workload, self.profile, role.shape
        P, T = plan.P, plan.T
        tp_x, _, pp_x = self._links(plan)
        h, V, layers = s.hidden_size, s.vocab_size, s.num_layers // P
        tab = prof.layer_table(s.compute_shape)
        ctx = w.prompt_len + (w.gen_len + 1) / 2.0
        eff = 1.0
        if w.cuda_graphs:  # whole-width attention, no launch cost per kernel; MoE: every expert on every row
            ctx = w.prompt_len + w.gen_len
            split, repl = layer_params(s.compute_shape)
            params = split / T + experts.static_step_extra_params(s, T)
            eff = prof.graph_decode_efficiency
            t_layer = max(prof.hbm_time((params + repl) * BF16), prof.gemm_time(2.0 * bm * params)) / eff
        else:
            t_layer = tab.decode(bm, T)
        if s.is_moe and not w.cuda_graphs:  # the experts the tokens touch beyond the active width; the dispatcher
            t_layer += (prof.hbm_time(experts.decode_extra_expert_bytes(s, bm, plan.E, plan.ETP, T)) / eff
                        + self._moe_comm(role, bm, plan))
        kv_read = prof.hbm_time(bm * ctx * s.kv_bytes_per_token(T, BF16)) / eff
        head = (max(prof.hbm_time(V * h / T * BF16), 2.0 * bm * h * V / T / (prof.peak_flops * prof.gemm_efficiency))
                if role.lm_head else 0.0)
        # vocab-parallel sampling exchanges (value, id) pairs across the TP group every step
        sample = prof.allreduce_time(bm * 16, T, tp_x) if role.lm_head else 0.0
        t_dec = (layers * (t_layer + kv_read + self._tp_comm(role, bm, plan, tp_x))
                 + head + sample + self._p2p(bm * h * BF16, P, pp_x))
        # P > 1: each step's sampled tokens go back from the last stage to the first before that
        # micro-batch's next step can start (puzzle.rollout.pipelined_generation): one more hop per step cycle
        return t_dec, self._p2p(bm * 8, P, pp_x)

    def _pipelined_prefill(self, role: ModelRole, plan: ParallelPlan, b: int, m: int) -> float:
        """Prefill of b prompts in micro-batches through P stages: the fastest split, from m
        micro-batches up by powers of two (bubbles against GEMM efficiency)."""
        w, prof, s = self.workload, self.profile, role.shape
        P, T = plan.P, plan.T
        tp_x, _, pp_x = self._links(plan)
        h, layers = s.hidden_size, s.num_layers // P
        tab = prof.layer_table(s.compute_shape)
        prefill = math.inf
        m_pre = m
        while True:
            bp = math.ceil(b / m_pre)
            tok = bp * w.prompt_len
            t_pre = (layers * (tab.fwd(tok, T) + self._unsplit_experts(role, tok, plan)
                               + self._tp_comm(role, tok, plan, tp_x) + self._moe_comm(role, tok, plan))
                     + self._head_fwd(role, bp, T) + self._p2p(tok * h * BF16, P, pp_x))
            prefill = min(prefill, pipeline_time(math.ceil(b / bp), P, t_pre))
            if m_pre >= b:
                break
            m_pre *= 2
        return prefill

    # -- switching ----------------------------------------------------------------------------
    def switch(self, role: ModelRole, src: ParallelPlan, dst: ParallelPlan) -> Tuple[int, float]:
        """(max bytes a rank lacks, time of the slowest rank) to move ``role`` from src to dst; a
        LoRA actor's adapters only (its frozen base is laid out on the generation ranks once, by
        the first switch, and kept: every iteration's switch after it moves the adapters)."""
        if src == dst:
            return 0, 0.0
        key = ("switch", role.shape, role.lm_head, src, dst, role.lora)
        if key not in self._cache:
            per = switch_bytes_per_rank(role.shape, src, dst, lm_head=role.lm_head,
                                        ranks_per_node=self.profile.ranks_per_node, adapters_of=role.lora)
            prof = self.profile
            nbytes = max((a + b for a, b in per.values()), default=0)
            t = max((a / prof.bandwidth(False) + b / prof.bandwidth(True) for a, b in per.values()), default=0.0)
            self._cache[key] = (nbytes, t)
        return self._cache[key]
