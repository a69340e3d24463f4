"""Per-device memory of PPO models under (P, D, T) plans (pure Python).

Static (resident for the whole run):
  * weights, bf16: 2 B/param of the rank's shard (every model);
  * trainable models (actor, critic): fp32 gradient buffer 4 B/param (megatron's main_grad)
    and Adam (fp32 master + 2 moments) 12 B/param, divided by D with the distributed optimizer;
    a LoRA actor: those of its adapters only (bf16 adapters beside the frozen base's weights);
Active (only during a stage; the peak of a rank is static + the largest stage):
  * training: activations of the micro-batches in flight; 1F1B keeps min(P - p, N_B) of them on
    stage p. Per layer and token (bf16, flash attention, SwiGLU, no recomputation): 8h bytes
    replicated over TP (the two norms' inputs/outputs) + (4h + 4*kv + 6*ffn)/T bytes split
    (Q, K, V, attention output, gate/up/product). Full recompute keeps only each recomputed
    group's input (2h bytes per token) per micro-batch in flight, plus one group's activations
    while it is recomputed; selective recompute (core attention) saves nothing under flash
    attention, which keeps no score matrix. Last stage with an LM head: bf16 logits and their
    gradient, 4*tokens*V/T bytes, plus the fp32 working set of one chunk of the sequence
    (puzzle.engine.vocab_parallel computes log-probs a chunk at a time);
  * scoring: two layers' worth of one micro-batch's activations + bf16 logits + a chunk's fp32
    working set;
  * generation: the shadow generation model (bf16 weights in the generation layout; absent when
    the generation plan equals the training plan) + the KV cache of the sequences live at once
    (at P = 1 the cache's rows, --generation-micro-batch-size, refilled as rows finish; at P > 1
    all of the replica's sequences) for the stage's layers (prompt + generated tokens) + one
    prefill's activations.
With ``offload_during_inference`` the trainable roles' gradients and optimizer states are on the
host during generation and scoring, the frozen roles' weights during generation.
Mixture-of-experts models (puzzle.plan_search.experts): the experts' weights, gradients and
optimizer states are split over E*ETP ranks, the optimizer states sharded over the EDP expert-
data-parallel ranks; a MoE layer's activations hold its routed (token, expert) pairs (topk per
token), the dispatcher's permuted tokens and the router's probabilities, in training those of the
rank's 1/T of the tokens (the layer splits them over T), in forward-only passes those of all of
them; the KV cache is the attention's, unchanged.
Models placed on the same devices in one stage run one after another or time-shared; PUZZLE
§4.2 shows time-sharing keeps the sequential peak, so a stage's active memory is the largest
of its models', not the sum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from puzzle.parallel.plan import ParallelPlan
from puzzle.plan_search import experts
from puzzle.plan_search.cost_model import (BF16, ModelRole, PPOWorkload, expert_params_on_rank, params_on_stage,
                                           trained_expert_params_on_rank, trained_params_on_stage)
from puzzle.plan_search.profile_data import Profile

GiB = float(1 << 30)
#: fp32 bytes of one chunk of the logits (puzzle.engine.vocab_parallel.LOGITS_CHUNK_BYTES) and
#: how many such tensors its computation holds at once (fp32 copy, shifted, exp, probabilities, grad)
LOGITS_CHUNK_BYTES = 256 << 20
CHUNK_WORKING_SET = 5


class MemoryFitError(ValueError):
    """A model/plan that does not fit the device; the message names model, plan and numbers."""

STAGES = ("generation", "scoring", "training")


def gib(x: float) -> str:
    return f"{x / GiB:.1f} GiB"


def fmt_plan(plan: ParallelPlan) -> str:
    """'(P,D,T)' or '(P,D,T)@offset'; with experts split '(P,D,T,E=e)' / '(P,D,T,E=e,ETP=x)'
    (ParallelPlan.parse reads every form)."""
    s = f"({plan.P},{plan.D},{plan.T})"
    if plan.has_experts_split:
        s = s[:-1] + f",E={plan.E}" + (f",ETP={plan.ETP})" if plan.ETP != plan.T else ")")
    return s if plan.offset == 0 else f"{s}@{plan.offset}"


@dataclass(frozen=True)
class MemoryReport:
    """Peak memory of one rank: ``items`` are (label, bytes); ``fits`` against the device."""

    rank: int
    stage: str
    items: Tuple[Tuple[str, float], ...]
    device_bytes: int

    @property
    def total(self) -> float:
        return sum(b for _, b in self.items)

    @property
    def fits(self) -> bool:
        return self.total <= self.device_bytes

    @property
    def overflow(self) -> float:
        return max(0.0, self.total - self.device_bytes)

    def describe(self, what: str = "") -> str:
        parts = " + ".join(f"{label} {b / GiB:.1f}" for label, b in self.items if b >= 0.05 * GiB)
        head = f"{what}: " if what else ""
        rel = ">" if not self.fits else "<="
        return (f"{head}rank {self.rank} during {self.stage} needs {gib(self.total)} {rel} "
                f"{gib(self.device_bytes)} ({parts} GiB)")


class MemoryModel:
    """Per-rank memory of roles under plans. Vectors are indexed by global rank 0..world-1."""

    def __init__(self, profile: Profile, workload: PPOWorkload):
        self.profile, self.workload = profile, workload
        self._cache: Dict[tuple, object] = {}

    # ---- per stage-index items -------------------------------------------------------
    def act_per_token_layer(self, role: ModelRole, T: int, E: int = 1, ETP: Optional[int] = None,
                            split: bool = True) -> float:
        """Activation bytes per token of an average layer (MoE layers' MLPs under (E, ETP); ``split``:
        they split their tokens over T, as in training, else every TP rank holds all of them)."""
        s = role.shape
        if not s.is_moe:
            return 8.0 * s.hidden_size + (4.0 * s.hidden_size + 4.0 * s.kv_dim + 6.0 * s.ffn_hidden_size) / T
        m = experts.moe_fraction(s)
        mlp = (1.0 - m) * 6.0 * s.ffn_hidden_size / T + m * experts.moe_activation_bytes_per_token(
            s, T, E, T if ETP is None else ETP, split)
        return 8.0 * s.hidden_size + (4.0 * s.hidden_size + 4.0 * s.kv_dim) / T + mlp

    def _logits(self, role: ModelRole, tokens: float, T: int, factor: float) -> float:
        """bf16 logits (factor 2; 4 with their gradient) + one chunk's fp32 working set."""
        if not role.lm_head:
            return 0.0
        fp32 = 4.0 * tokens * role.shape.vocab_size / T
        return factor / 4.0 * fp32 + CHUNK_WORKING_SET * min(fp32, LOGITS_CHUNK_BYTES)

    def static_items(self, role: ModelRole, plan: ParallelPlan, p: int,
                     stage: str = "training") -> List[Tuple[str, float]]:
        """What ``role`` keeps on the device during ``stage`` (offloaded parts left out)."""
        phi = params_on_stage(role, plan.P, plan.T, p)
        phe = expert_params_on_rank(role, plan)
        offload = self.workload.offload_during_inference
        dist = self.workload.distributed_optimizer
        items = []
        if role.trainable or not (offload and stage == "generation"):
            items.append((f"{role.name} weights", BF16 * phi))
            if phe:
                items.append((f"{role.name} expert weights", BF16 * phe))
        if role.lora is not None:  # the frozen base has no gradients nor optimizer state: the adapters have
            phi, phe = trained_params_on_stage(role, plan.P, plan.T, p), trained_expert_params_on_rank(role, plan)
            items.append((f"{role.name} adapters", BF16 * phi))
            if phe:
                items.append((f"{role.name} expert adapters", BF16 * phe))
        if role.trainable and not (offload and stage in ("generation", "scoring")):
            items.append((f"{role.name} grads", 4.0 * phi))
            items.append((f"{role.name} optimizer", 12.0 * phi / (plan.D if dist else 1)))
            if phe:
                items.append((f"{role.name} expert grads", 4.0 * phe))
                items.append((f"{role.name} expert optimizer", 12.0 * phe / (plan.EDP if dist else 1)))
        return items

    def offloaded_bytes(self, role: ModelRole, plan: ParallelPlan, p: int) -> float:
        """Bytes ``role`` copies to the host and back per iteration with offload on (gradients
        are freed and re-zeroed, not copied)."""
        if not self.workload.offload_during_inference:
            return 0.0
        phi = params_on_stage(role, plan.P, plan.T, p)
        phe = expert_params_on_rank(role, plan)
        dist = self.workload.distributed_optimizer
        if role.trainable:
            phi, phe = trained_params_on_stage(role, plan.P, plan.T, p), trained_expert_params_on_rank(role, plan)
            return 12.0 * phi / (plan.D if dist else 1) + 12.0 * phe / (plan.EDP if dist else 1)
        return BF16 * (phi + phe)

    def activations(self, role: ModelRole, layers: int, tokens: float, inflight: int, T: int,
                    E: int = 1, ETP: Optional[int] = None) -> float:
        """Training activations of ``inflight`` micro-batches of ``tokens`` over ``layers`` layers,
        with the workload's recompute."""
        w, per_layer = self.workload, tokens * self.act_per_token_layer(role, T, E, ETP)
        if w.recompute_granularity != "full":
            return inflight * layers * per_layer
        n = min(w.recompute_num_layers, layers)
        boundary = tokens * 2.0 * role.shape.hidden_size  # a recomputed group's input, bf16
        if w.recompute_method == "uniform":
            return inflight * math.ceil(layers / n) * boundary + n * per_layer
        return inflight * (n * boundary + (layers - n) * per_layer) + per_layer

    def train_items(self, role: ModelRole, plan: ParallelPlan, p: int) -> List[Tuple[str, float]]:
        w = self.workload
        samples = math.ceil(w.rollout_batch_size / w.ppo_minibatches / plan.D)
        n_micro, _, tokens = w.micro_batches(samples, "training")  # the largest micro-batch's tokens
        inflight = min(plan.P - p, n_micro)
        act = self.activations(role, role.shape.num_layers // plan.P, tokens, inflight, plan.T, plan.E, plan.ETP)
        items = [(f"{role.name} activations", act)]
        if p == plan.P - 1 and role.lm_head:
            items.append((f"{role.name} logits", self._logits(role, tokens, plan.T, 4.0)))
        return items

    def forward_items(self, role: ModelRole, plan: ParallelPlan, p: int) -> List[Tuple[str, float]]:
        w = self.workload
        _, _, tokens = w.micro_batches(math.ceil(w.rollout_batch_size / plan.D), "scoring")
        per_token = self.act_per_token_layer(role, plan.T, plan.E, plan.ETP, split=False)  # forward-only
        items = [(f"{role.name} activations", 2 * tokens * per_token)]
        if p == plan.P - 1 and role.lm_head:
            items.append((f"{role.name} logits", self._logits(role, tokens, plan.T, 2.0)))
        return items

    def generation_rows(self, plan: ParallelPlan) -> int:
        """Sequences with a KV cache at once on a replica (see the module docstring)."""
        w = self.workload
        b = math.ceil(w.rollout_batch_size / plan.D)
        return min(w.generation_micro_batch_size or b, b) if plan.P == 1 else b

    def kv_bytes_per_sequence(self, role: ModelRole, plan: ParallelPlan) -> float:
        """bf16 keys and values of one sequence of the workload's length (ModelShape's formula)."""
        return role.shape.kv_bytes_per_sequence(self.workload.seq_len, plan, BF16)

    def generation_items(self, role: ModelRole, plan: ParallelPlan, p: int, shadow: bool) -> List[Tuple[str, float]]:
        w, s = self.workload, role.shape
        rows = self.generation_rows(plan)
        bm = math.ceil(rows / min(plan.P, rows))
        items = []
        if shadow:
            items.append((f"{role.name} shadow weights", BF16 * (params_on_stage(role, plan.P, plan.T, p)
                                                                 + expert_params_on_rank(role, plan))))
        items.append((f"{role.name} KV cache", rows * self.kv_bytes_per_sequence(role, plan)))
        prefill = 2 * bm * w.prompt_len * self.act_per_token_layer(role, plan.T, plan.E, plan.ETP, split=False)
        items.append((f"{role.name} prefill activations", prefill))
        if p == plan.P - 1:
            items.append((f"{role.name} logits", self._logits(role, bm, plan.T, 4.0)))
        return items

    def items(self, kind: str, role: ModelRole, plan: ParallelPlan, p: int, shadow: bool = True):
        if kind == "static":
            return self.static_items(role, plan, p)
        if kind == "offload_saving":  # what offload frees during generation
            kept = sum(b for _, b in self.static_items(role, plan, p, "generation"))
            return [("offloaded", sum(b for _, b in self.static_items(role, plan, p)) - kept)]
        if kind == "training":
            return self.train_items(role, plan, p)
        if kind == "scoring":
            return self.forward_items(role, plan, p)
        if kind == "generation":
            return self.generation_items(role, plan, p, shadow)
        raise ValueError(f"unknown memory kind {kind!r}")

    # ---- per-rank vectors (fast path of the search) ------------------------------------------
    def vector(self, kind: str, role: ModelRole, plan: ParallelPlan, world: int,
               shadow: bool = True) -> Tuple[float, ...]:
        """Bytes of ``kind`` ('static', 'training', 'scoring', 'generation') on every global rank."""
        key = (kind, role, plan, world, shadow)
        v = self._cache.get(key)
        if v is None:
            per_stage = [sum(b for _, b in self.items(kind, role, plan, p, shadow)) for p in range(plan.P)]
            stage_ranks = plan.D * plan.T
            v = tuple(per_stage[(r - plan.offset) // stage_ranks] if plan.contains(r) else 0.0 for r in range(world))
            self._cache[key] = v
        return v

    # ---- single-model check ----------------------------------------------------------
    def usable_report(self, rank: int, stage: str, items: Sequence[Tuple[str, float]]) -> MemoryReport:
        its = tuple(items) + (("reserved", float(self.profile.memory_reserved_bytes)),)
        return MemoryReport(rank, stage, its, self.profile.device_memory_bytes)

    def model_alone(self, role: ModelRole, plan: ParallelPlan, stage: str) -> MemoryReport:
        """Peak rank of ``role`` alone running ``stage`` under ``plan`` (static + that stage).
        For generation the static part is the generation layout's weights only (no shadow)."""
        worst = None
        for p in range(plan.P):
            if stage == "generation":
                its = [(f"{role.name} weights", BF16 * (params_on_stage(role, plan.P, plan.T, p)
                                                        + expert_params_on_rank(role, plan)))]
                its += self.generation_items(role, plan, p, shadow=False)
            else:
                its = self.static_items(role, plan, p) + self.items(stage, role, plan, p)
            rep = self.usable_report(plan.rank(p, 0, 0), stage, its)
            if worst is None or rep.total > worst.total:
                worst = rep
        return worst

    def check_model(self, role: ModelRole, plan: ParallelPlan, stage: str) -> MemoryReport:
        """Raise :class:`MemoryFitError` naming model, plan and numbers when ``role`` alone does not fit."""
        rep = self.model_alone(role, plan, stage)
        if not rep.fits:
            raise MemoryFitError(rep.describe(f"{role.name} {stage} plan {fmt_plan(plan)}"))
        return rep

    # ---- whole-configuration breakdown (for messages) -----------------------------------
    def rank_report(self, rank: int, placement: Dict[str, Dict[str, ParallelPlan]],
                    roles: Dict[str, ModelRole], shadow: bool) -> MemoryReport:
        """Worst stage of ``rank`` for a configuration ``placement[model][stage] = plan``."""
        return max(self.stage_reports(rank, placement, roles, shadow), key=lambda r: r.total)

    def stage_reports(self, rank: int, placement: Dict[str, Dict[str, ParallelPlan]],
                      roles: Dict[str, ModelRole], shadow: bool) -> List[MemoryReport]:
        """``rank``'s peak in every stage; static memory comes from each model's home (training
        or scoring) plan."""
        reports = []
        for stage in STAGES:
            static: List[Tuple[str, float]] = []
            for name, stages in placement.items():
                home = stages.get("training") or stages.get("scoring")
                if home is not None and home.contains(rank):
                    static += self.static_items(roles[name], home, home.coords(rank)[0], stage)
            act: List[List[Tuple[str, float]]] = []
            for name, stages in placement.items():
                plan = stages.get(stage)
                if plan is not None and plan.contains(rank):
                    act.append(self.items(stage, roles[name], plan, plan.coords(rank)[0], shadow))
            if stage == "generation":
                chosen = [i for a in act for i in a]
            else:
                chosen = max(act, key=lambda a: sum(b for _, b in a), default=[])
            reports.append(self.usable_report(rank, stage, static + chosen))
        return reports
