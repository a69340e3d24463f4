"""Plan search for a PPO iteration (PUZZLE §4.3 hybrid placement, §5.3 Eq. (2)), pure Python.

A configuration chooses, for a world of N ranks:

* a *layout*: ``colocated`` (all four models on all N ranks) or ``disjoint@k`` (actor and ref on
  ranks [0, k), critic and reward on [k, N), k in N/4, N/2, 3N/4);
* plans: A = actor training plan (also its home for scoring), G = actor generation plan (the actor's
  ranks), C = critic plan (training and scoring), R = ref plan, W = reward plan (scoring).

Stage placement follows what the trainer runs: colocated stages run their models on the same
devices, time-shared by Eq. (1) when every model of the stage has the same P (and, where experts
are split, the same plan: puzzle.parallel.streams) ('time-sharing'; Eq. (1) never exceeds the
sequential sum, so the search needs no separate branch), otherwise one after another
('sequential'); a disjoint layout runs its two device groups concurrently
('disjoint', the stage takes the slower group; each group's models one after another).
Objective (Eq. (2) extended to all models and stages)::

    T_gen(G) + T_switch(A -> G) + T_scoring(A, C, R, W) + T_training(A, C)

subject to every rank's peak memory fitting the device (memory_model). Degrees P and T are
powers of two, T <= ranks_per_node, D = group size / (P*T). A MoE model's plans also choose E and
ETP (:func:`expert_degrees`); a MoE actor, like a dense one, may generate at another (P, D, T, E)
than it trains at (the switch moves its experts between E layouts, priced by its bytes). Every
rank holds part of a trainable model (runs build the optimizers over the whole world), so a
disjoint layout needs a critic on its second group.

* :func:`similarity_search`: from each stage's individually best plans (and variants where the
  generation plan starts at the training plan, or the other models align their P with the
  actor's for time-sharing), steepest descent over "similar" plans -- one factor-2 exchange
  between two of P, D, T (e.g. the paper's "reduce P, raise T") -- while the total decreases.
* :func:`exhaustive_search`: the whole space with exact branch-and-bound pruning, to verify.
"""

from __future__ import annotations

import heapq
import math
import operator
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from puzzle.model_shape import ModelShape
from puzzle.parallel.plan import ParallelPlan
from puzzle.plan_search.cost_model import (CostModel, PPOWorkload, TaskCost, colocated_time, plan_problems,
                                    ppo_roles, sequential_time)
from puzzle.plan_search.memory_model import GiB, MemoryModel, fmt_plan
from puzzle.plan_search.profile_data import Profile, load_profile

VARS = ("A", "G", "C", "R", "W")
#: variable -> (model, stage whose time/memory picks it alone, device group 'a' | 'c' | 'all')
# The actor generates on its training ranks: the switch reshards between layouts of the same ranks
# (puzzle.switch), so in a disjoint layout generation stays on the actor's group.
VAR_INFO = {"A": ("actor", "training", "a"), "G": ("actor", "generation", "a"),
            "C": ("critic", "training", "c"), "R": ("ref", "scoring", "a"), "W": ("reward", "scoring", "c")}
_EXCHANGES = [(i, j) for i in range(3) for j in range(3) if i != j]  # multiply dim i by 2, divide dim j by 2
#: then the expert moves (MoE models only): E x 2, E / 2; ETP from T to 1 or back, at the same E and
#: keeping E * ETP (the experts' split per rank)
_MOVES = len(_EXCHANGES) + 4


class InfeasibleError(RuntimeError):
    """No configuration fits; the message lists why the closest ones were rejected."""


@dataclass
class PPOJob:
    """What to place: world size, model shapes (ref mirrors the actor, reward the critic unless
    given), the PPO workload and the device profile (default: the bundled A100-80GB)."""

    world_size: int
    actor: ModelShape
    critic: ModelShape
    workload: PPOWorkload
    profile: Optional[Profile] = None
    ref: Optional[ModelShape] = None
    reward: Optional[ModelShape] = None
    disjoint_fractions: Tuple[float, ...] = (0.25, 0.5, 0.75)
    #: the roles the run builds (critic-free estimators have no critic, --kl-coef 0 no reference, a
    #: reward function no reward model); absent ones take no time, memory or plan
    roles: Tuple[str, ...] = ("actor", "critic", "ref", "reward")
    #: a LoRA actor: (dim, target modules); with a KL term its base (adapters off) is the reference,
    #: priced as a second actor forward in scoring (no 'ref' in ``roles``)
    actor_lora: Optional[Tuple[int, Tuple[str, ...]]] = None
    critic_lora: Optional[Tuple[int, Tuple[str, ...]]] = None  # a LoRA critic (its value head trained whole)
    reference_is_actor_base: bool = False


@dataclass
class SearchResult:
    method: str
    layout: str
    plans: Dict[str, Dict[str, ParallelPlan]]
    placements: Dict[str, str]
    stage_times: Dict[str, float]
    total_time: float
    switch_bytes: int
    switch_time: float
    memory_bytes: List[float]
    plans_evaluated: int
    space_size: int
    seconds: float
    levers: Dict[str, object] = field(default_factory=dict)  # flags of the memory levers it needs

    @property
    def peak_memory_bytes(self) -> float:
        return max(self.memory_bytes)

    def to_dict(self) -> dict:
        return {"method": self.method, "layout": self.layout,
                "plans": {m: {s: fmt_plan(p) for s, p in st.items()} for m, st in self.plans.items()},
                "placements": dict(self.placements),
                "stage_times": {k: round(v, 6) for k, v in self.stage_times.items()},
                "total_time": round(self.total_time, 6), "switch_bytes": self.switch_bytes,
                "switch_time": round(self.switch_time, 6), "peak_memory_gib": round(self.peak_memory_bytes / GiB, 2),
                "plans_evaluated": self.plans_evaluated, "space_size": self.space_size,
                "seconds": round(self.seconds, 4), "levers": dict(self.levers)}


def expert_degrees(shape: ModelShape, D: int, T: int) -> List[Tuple[int, int]]:
    """(E, ETP) choices of a (D, T) stage: (1, T) for a dense model; for a MoE model every E that
    divides num_experts with ETP in (T, 1), E * ETP dividing the stage's D*T ranks (megatron-core's
    expert grid re-splits the same ranks: ETP x EP x EDP = TP x DP)."""
    if not shape.is_moe:
        return [(1, T)]
    out = []
    for ETP in sorted({T, 1}, reverse=True):
        if shape.moe_ffn_hidden_size % ETP:
            continue
        out += [(E, ETP) for E in range(1, shape.num_experts + 1)
                if shape.num_experts % E == 0 and (D * T) % (E * ETP) == 0]
    return out


def candidate_plans(shape: ModelShape, n: int, offset: int, workload: PPOWorkload, stage: str,
                    ranks_per_node: int) -> Tuple[List[ParallelPlan], List[str]]:
    """Plans of one model on ranks [offset, offset + n): P, T powers of two, T <= ranks_per_node;
    for a MoE model also E and ETP (:func:`expert_degrees`). Returns (valid plans, 'why not' lines
    for the rejected ones)."""
    ok, bad = [], []
    P = 1
    while P <= n:
        T = 1
        while P * T <= n and T <= ranks_per_node:
            if n % (P * T) == 0:
                for E, ETP in expert_degrees(shape, n // (P * T), T):
                    plan = ParallelPlan(P, n // (P * T), T, offset, E=E, ETP=ETP)
                    why = plan_problems(shape, plan, workload, stage, ranks_per_node)
                    (bad.append(f"{fmt_plan(plan)}: " + "; ".join(why)) if why else ok.append(plan))
            T *= 2
        P *= 2
    return ok, bad


def _plan_key(q: ParallelPlan) -> tuple:
    """(P, D, T, E, ETP) with ETP 0 when it follows T (an exchange keeps that)."""
    return q.P, q.D, q.T, q.E, 0 if q.ETP == q.T else q.ETP


def _exchanged(key: List[int], where: Dict[tuple, int]) -> int:
    """Index of the plan with key ``key`` after a (P, D, T) exchange, -1 if none. ETP follows T
    where that plan exists, else a MoE plan keeps ETP = 1 (at T = 1 both are the same plan)."""
    if key[2] == 1:
        key[4] = 0
    idx = where.get(tuple(key), -1)
    if idx < 0 and key[4] == 0 and key[2] > 1:
        idx = where.get(tuple(key[:4]) + (1,), -1)
    return idx


def _etp_moves(q: ParallelPlan, where: Dict[tuple, int]) -> List[int]:
    """Indices of ``q`` with ETP switched between T and 1 (T > 1): at the same E, and with E scaled
    to keep E * ETP; -1 where no such plan exists."""
    if q.T == 1:
        return [-1, -1]
    etp = 1 if q.ETP == q.T else q.T
    key = lambda E: (q.P, q.D, q.T, E, 0 if etp == q.T else etp)
    scaled = q.E * q.ETP // etp if (q.E * q.ETP) % etp == 0 else 0
    return [where.get(key(q.E), -1), where.get(key(scaled), -1) if scaled else -1]


class _Layout:
    """One layout's candidate plans per variable, with per-plan costs and memory vectors.
    Configurations are tuples of plan indices ``(li, a, g, c, r, w)``."""

    def __init__(self, ev: "_Evaluator", li: int, k: Optional[int]):
        self.li, self.k = li, k
        self.name = "colocated" if k is None else f"disjoint@{k}"
        N, rpn = ev.N, ev.profile.ranks_per_node
        groups = {"all": (N, 0), "a": (k or N, 0), "c": (N - k, k) if k else (N, 0)}
        self.plans: Dict[str, List[ParallelPlan]] = {}
        self.missing: List[str] = []
        for v, (model, stage, g) in VAR_INFO.items():
            n, off = groups[g]
            if model not in ev.job.roles:  # one placeholder plan, costed at zero, never reported
                self.plans[v] = [ParallelPlan(1, n, 1, off)]
                continue
            plans, bad = candidate_plans(ev.roles[model].shape, n, off, ev.w, stage, rpn)
            if not plans:
                self.missing.append(f"layout {self.name}: {model} {stage} on {n} ranks has no valid (P,D,T): "
                                    + "; ".join(bad))
            self.plans[v] = plans
        self.ok = not self.missing
        if not self.ok:
            return
        self.task = {v: [ev.task(v, q) for q in self.plans[v]] for v in VARS}
        # forward passes of the trainable models' home plans in the scoring stage
        self.fwd = {v: [ev.cost.forward_cost(ev.roles[VAR_INFO[v][0]], q) if v not in ev.absent else self.task[v][i]
                        for i, q in enumerate(self.plans[v])] for v in ("A", "C")}
        vec = ev.mem.vector
        roles = {v: ev.roles[VAR_INFO[v][0]] for v in VARS}
        self.static = {v: [vec("static", roles[v], q, N) if v not in ev.absent else (0.0,) * N
                           for q in self.plans[v]] for v in ("A", "C", "R", "W")}
        self.act = {}
        for v in ("A", "C", "R", "W"):
            self.act[v] = []
            for q in self.plans[v]:
                if v in ev.absent:
                    self.act[v].append((0.0,) * N)
                    continue
                sc = vec("scoring", roles[v], q, N)
                if v in ("A", "C"):
                    sc = tuple(map(max, sc, vec("training", roles[v], q, N)))
                self.act[v].append(sc)
        # with offload, what each model frees during generation (its static vector is training's)
        self.gsave = {v: [vec("offload_saving", roles[v], q, N) if v not in ev.absent else (0.0,) * N
                          for q in self.plans[v]] for v in ("A", "C", "R", "W")}
        self.gen = [vec("generation", roles["G"], q, N, True) for q in self.plans["G"]]
        self.gen_lean = [vec("generation", roles["G"], q, N, False) for q in self.plans["G"]]
        self.smax = {v: [max(x) for x in self.static[v]] for v in self.static}
        self.amax = {v: [max(x) for x in self.act[v]] for v in self.act}
        self.gmax = [max(x) for x in self.gen]
        gidx = {q: i for i, q in enumerate(self.plans["G"])}
        self.g_same = [gidx.get(q, -1) for q in self.plans["A"]]  # G index equal to the training plan
        # exchange table: exch[v][i][e] = index of plan i with exchange e applied, -1 if none
        self.exch = {}
        for v in VARS:
            where = {_plan_key(q): i for i, q in enumerate(self.plans[v])}
            rows = []
            for q in self.plans[v]:
                row = []
                for i, j in _EXCHANGES:
                    d = list(_plan_key(q))
                    if d[j] % 2:
                        row.append(-1)
                        continue
                    d[i] *= 2
                    d[j] //= 2
                    row.append(_exchanged(d, where))
                key = _plan_key(q)
                row.append(where.get(key[:3] + (q.E * 2,) + key[4:], -1))
                row.append(where.get(key[:3] + (q.E // 2,) + key[4:], -1) if q.E % 2 == 0 else -1)
                row += _etp_moves(q, where)
                rows.append(row)
            self.exch[v] = rows

    def size(self) -> int:
        return math.prod(len(self.plans[v]) for v in VARS) if self.ok else 0

    def cfg_plans(self, cfg) -> Tuple[ParallelPlan, ...]:
        return tuple(self.plans[v][i] for v, i in zip(VARS, cfg[1:]))


class _Evaluator:
    """Shared by both searches: layouts, cached stage times, memory, rejections."""

    def __init__(self, job: PPOJob):
        self.job, self.N = job, job.world_size
        self.profile = job.profile or load_profile("a100_80gb")
        self.w = job.workload
        self.roles = ppo_roles(job.actor, job.critic, job.ref, job.reward, actor_lora=job.actor_lora,
                               critic_lora=job.critic_lora)
        self.absent = {v for v, (model, _, _) in VAR_INFO.items() if model not in job.roles}
        self.cost = CostModel(self.profile, self.w)
        self.mem = MemoryModel(self.profile, self.w)
        self.usable = self.profile.device_memory_bytes - self.profile.memory_reserved_bytes
        # a disjoint layout's second group holds the critic and the reward model: without a critic
        # its ranks would hold no trainable model (refused at run start), so no disjoint layouts
        fractions = job.disjoint_fractions if "critic" in job.roles else ()
        splits = sorted({int(round(self.N * f)) for f in fractions} - {0, self.N})
        self.layouts = [_Layout(self, li, k) for li, k in enumerate([None] + splits)]
        self.n_evals = 0
        self._memo: Dict[tuple, Tuple[float, float]] = {}
        self._train: Dict[tuple, Tuple[float, bool]] = {}
        self._score: Dict[tuple, Tuple[float, bool]] = {}
        self._gsw: Dict[tuple, float] = {}
        self._base: Dict[tuple, list] = {}
        self.rejected: List[Tuple[float, int, tuple]] = []  # (-overflow, seq, cfg): the 5 smallest overflows
        self._seq = 0

    def describe(self, cfg) -> str:
        A, G, C, R, W = self.layouts[cfg[0]].cfg_plans(cfg)
        parts = [f"actor train {fmt_plan(A)} gen {fmt_plan(G)}"] + [
            f"{m} {fmt_plan(q)}" for m, q in (("critic", C), ("ref", R), ("reward", W)) if m in self.job.roles]
        return ", ".join(parts) + f" [{self.layouts[cfg[0]].name}]"

    # ---- times -------------------------------------------------------------------------------
    def task(self, var: str, plan: ParallelPlan) -> TaskCost:
        model, stage, _ = VAR_INFO[var]
        role = self.roles[model]
        if var in self.absent:
            return TaskCost(model, "forward", plan, 0, 0.0, 0.0, 1, 0.0)
        if stage == "training":
            return self.cost.train_cost(role, plan)
        if stage == "generation":
            return self.cost.generation_cost(role, plan)
        return self.cost.forward_cost(role, plan)

    def gen_switch(self, li: int, a: int, g: int) -> float:
        key = (li, a, g)
        t = self._gsw.get(key)
        if t is None:
            L = self.layouts[li]
            sw = self.cost.switch(self.roles["actor"], L.plans["A"][a], L.plans["G"][g])[1]
            t = self._gsw[key] = L.task["G"][g].total + sw
        return t

    def train_time(self, li: int, a: int, c: int) -> Tuple[float, bool]:
        key = (li, a, c)
        r = self._train.get(key)
        if r is None:
            L = self.layouts[li]
            ta, tc = L.task["A"][a], L.task["C"][c]
            if "C" in self.absent:
                r = (ta.total, False)
            else:
                r = (max(ta.total, tc.total), False) if L.k is not None else colocated_time([ta, tc])
            self._train[key] = r
        return r

    def score_time(self, li: int, a: int, c: int, r: int, w: int) -> Tuple[float, bool]:
        key = (li, a, c, r, w)
        res = self._score.get(key)
        if res is None:
            L = self.layouts[li]
            side_a = [L.task["R"][r], L.fwd["A"][a]] if self.w.actor_logprobs_in_scoring else [L.task["R"][r]]
            side_c = [L.fwd["C"][c], L.task["W"][w]]
            side_a = [t for t, v in zip(side_a, ("R", "A")) if v not in self.absent]
            if self.job.reference_is_actor_base:  # the LoRA actor's base: its forward again
                side_a.append(L.fwd["A"][a])
            side_c = [t for t, v in zip(side_c, ("C", "W")) if v not in self.absent]
            if L.k is not None:  # 'disjoint': each group's models one after another
                res = (max(sequential_time(side_a), sequential_time(side_c)), False)
            else:
                res = colocated_time(side_a + side_c)
            self._score[key] = res
        return res

    def total(self, cfg) -> float:
        li, a, g, c, r, w = cfg
        return (self.train_time(li, a, c)[0] + self.score_time(li, a, c, r, w)[0] + self.gen_switch(li, a, g)
                + self.offload_time(li, a, c, r, w))

    def offload_time(self, li: int, a: int, c: int, r: int, w: int) -> float:
        """Host round trip of the offloaded state (--rl-offload-optimizer-during-inference)."""
        if not self.w.offload_during_inference:
            return 0.0
        plans = dict(zip(("A", "C", "R", "W"), (self.layouts[li].plans[v][i] for v, i in
                                                 zip(("A", "C", "R", "W"), (a, c, r, w)))))
        return sum(self.cost.offload_cost(self.roles[VAR_INFO[v][0]], q) for v, q in plans.items()
                   if v not in self.absent)

    def generation_peak(self, li: int, a: int, g: int, c: int, r: int, w: int) -> list:
        """Per rank: static + the larger of the scoring/training activations and generation (less
        what offload frees during generation)."""
        L = self.layouts[li]
        st, act = self.base_memory(li, a, c, r, w)
        gen = L.gen[g] if L.g_same[a] != g else L.gen_lean[g]
        if self.w.offload_during_inference:
            saved = list(map(lambda p, q, x, y: p + q + x + y, L.gsave["A"][a], L.gsave["C"][c],
                             L.gsave["R"][r], L.gsave["W"][w]))
            gen = [y - z for y, z in zip(gen, saved)]
        return [s + (x if x > y else y) for s, x, y in zip(st, act, gen)]

    # ---- memory ------------------------------------------------------------------------------
    def base_memory(self, li: int, a: int, c: int, r: int, w: int) -> list:
        """Per rank (static bytes, largest scoring/training activation bytes)."""
        key = (li, a, c, r, w)
        v = self._base.get(key)
        if v is None:
            L = self.layouts[li]
            st = list(map(lambda p, q, x, y: p + q + x + y, L.static["A"][a], L.static["C"][c],
                          L.static["R"][r], L.static["W"][w]))
            act = list(map(max, L.act["A"][a], L.act["C"][c], L.act["R"][r], L.act["W"][w]))
            v = self._base[key] = (st, act)
            if len(self._base) > 100000:
                self._base.clear()
        return v

    def overflow(self, cfg) -> float:
        """Bytes by which the fullest rank exceeds the usable device memory (0: fits)."""
        li, a, g, c, r, w = cfg
        L = self.layouts[li]
        bound = (L.smax["A"][a] + L.smax["C"][c] + L.smax["R"][r] + L.smax["W"][w]
                 + max(L.amax["A"][a], L.amax["C"][c], L.amax["R"][r], L.amax["W"][w], L.gmax[g]))
        if bound <= self.usable:  # even the worst ranks of every part together fit
            return 0.0
        return max(0.0, max(self.generation_peak(li, a, g, c, r, w)) - self.usable)

    def evaluate(self, cfg) -> Tuple[float, float]:
        """(objective, overflow bytes); memoised; counts plans_evaluated."""
        res = self._memo.get(cfg)
        if res is None:
            self.n_evals += 1
            res = self._memo[cfg] = (self.total(cfg), self.overflow(cfg))
            if res[1] > 0:
                self.reject(res[1], cfg)
        return res

    def reject(self, ov: float, cfg) -> None:
        self._seq += 1
        if len(self.rejected) < 5:
            heapq.heappush(self.rejected, (-ov, self._seq, cfg))
        elif -self.rejected[0][0] > ov:
            heapq.heapreplace(self.rejected, (-ov, self._seq, cfg))

    def penalised(self, cfg) -> float:
        t, ov = self.evaluate(cfg)
        return t if ov <= 0 else 1e9 + ov / GiB * 1e3 + t  # walk towards feasibility first

    # ---- results / errors -----------------------------------------------------------------
    def placement(self, cfg) -> Dict[str, Dict[str, ParallelPlan]]:
        A, G, C, R, W = self.layouts[cfg[0]].cfg_plans(cfg)
        out = {"actor": {"generation": G, "scoring": A, "training": A}, "critic": {"scoring": C, "training": C},
               "ref": {"scoring": R}, "reward": {"scoring": W}}
        return {m: st for m, st in out.items() if m in self.job.roles}

    def result(self, cfg, method: str, seconds: float) -> SearchResult:
        li, a, g, c, r, w = cfg
        L = self.layouts[li]
        A, G, C, R, W = L.cfg_plans(cfg)
        tr, tr_shared = self.train_time(li, a, c)
        sc, sc_shared = self.score_time(li, a, c, r, w)
        sw_bytes, sw_time = self.cost.switch(self.roles["actor"], A, G)
        mem = [x + self.profile.memory_reserved_bytes for x in self.generation_peak(li, a, g, c, r, w)]
        disjoint = L.k is not None
        place = {"generation": "single",
                 "scoring": "disjoint" if disjoint else ("time-sharing" if sc_shared else "sequential"),
                 "training": "disjoint" if disjoint else ("time-sharing" if tr_shared else "sequential")}
        return SearchResult(method, L.name, self.placement(cfg), place,
                            {"generation": L.task["G"][g].total, "switch": sw_time, "scoring": sc, "training": tr},
                            self.total(cfg), sw_bytes, sw_time, mem, self.n_evals, self.space_size(), seconds)

    def space_size(self) -> int:
        return sum(L.size() for L in self.layouts)

    def infeasible(self) -> InfeasibleError:
        j = self.job
        size = lambda n: f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
        lines = [f"no feasible plan for actor {size(j.actor.param_count())} / critic "
                 f"{size(j.critic.param_count(False))} on {self.N} ranks "
                 f"({self.profile.name}, {self.profile.device_memory_bytes / GiB:.0f} GiB per device)"]
        lines += [f"  {m}" for L in self.layouts for m in L.missing]
        if self.rejected:
            lines.append("  closest configurations:")
            for _, _, cfg in sorted(self.rejected, reverse=True):
                L = self.layouts[cfg[0]]
                shadow = L.g_same[cfg[1]] != cfg[2]
                worst = max((self.mem.rank_report(r, self.placement(cfg), self.roles, shadow) for r in range(self.N)),
                            key=lambda rep: rep.total)
                lines.append(f"  - {worst.describe(self.describe(cfg))}")
        return InfeasibleError("\n".join(lines))


# ---- similarity-oriented search ----------------------------------------------------------------
def _individual_best(ev: _Evaluator, L: _Layout, var: str, pred=None, lean: bool = False) -> Optional[int]:
    """Index of the fastest plan of one model alone that fits alone (else the least overflowing);
    ``lean``: the fastest among those with the smallest peak memory."""
    model, stage, _ = VAR_INFO[var]
    role = ev.roles[model]
    best, best_key = None, None
    for i, plan in enumerate(L.plans[var]):
        if pred is not None and not pred(plan):
            continue
        rep = ev.mem.model_alone(role, plan, stage)
        key = ((round(rep.total / GiB, 1) if lean else rep.overflow), L.task[var][i].total)
        if best_key is None or key < best_key:
            best, best_key = i, key
    return best


def _starting_points(ev: _Evaluator, L: _Layout) -> List[tuple]:
    """Each stage's individually best plans; then, for every pipeline degree p, the best plans
    with P = p for A, C, R, W, also mixed with the individually best or the least-memory (lean)
    frozen models, and with C, R, W at the actor's plan where they have it (time-sharing of split
    experts needs the same plan). The generation plan starts at its own best and at the training plan's (P, T) over
    all ranks -- the paper's starting point, from which the descent "reduces P and raises T"."""
    ind = {v: _individual_best(ev, L, v) for v in VARS}
    lean = {v: _individual_best(ev, L, v, lean=True) for v in ("R", "W")}
    gen_by_pt = {(q.P, q.T): i for i, q in enumerate(L.plans["G"])}
    idx = {v: {q: i for i, q in enumerate(L.plans[v])} for v in ("C", "R", "W")}
    ref_idx = idx["R"]
    gen_idx = {q: i for i, q in enumerate(L.plans["G"])}
    starts = []
    for p in [None] + sorted({q.P for q in L.plans["A"]}):
        if p is None:
            pick = ind
        else:
            pick = {v: _individual_best(ev, L, v, lambda q: q.P == p) for v in ("A", "C", "R", "W")}
            pick = {v: ind[v] if i is None else i for v, i in pick.items()}
        a = pick["A"]
        qa = L.plans["A"][a]
        variants = [(pick["C"], pick["R"], pick["W"]), (pick["C"], ind["R"], ind["W"]), (ind["C"], pick["R"], ind["W"]),
                    (pick["C"], lean["R"], lean["W"]), (ind["C"], lean["R"], lean["W"])]
        if qa.has_experts_split and qa in ref_idx:  # MoE: the reference also at the actor's layout
            variants += [(c, ref_idx[qa], w) for c, _, w in variants[:2]]
        variants.append(tuple(idx[v].get(qa, pick[v]) for v in ("C", "R", "W")))  # all at the actor's plan
        for g in (ind["G"], gen_by_pt.get((qa.P, qa.T)), gen_idx.get(qa)):
            if g is not None:
                starts += [(L.li, a, g, c, r, w) for c, r, w in variants]
    return list(dict.fromkeys(starts))


def _descend(ev: _Evaluator, cfg: tuple, pairs: bool = False) -> tuple:
    """Steepest descent over similar plans: one factor-2 exchange between two of (P, D, T) of one
    model, or the same exchange on A, C, R, W together (keeps equal plans equal for time-sharing);
    with ``pairs``, moves of two models at once when no single move helps."""
    L = ev.layouts[cfg[0]]
    tables = [L.exch[v] for v in VARS]
    cur, cur_c = cfg, ev.penalised(cfg)
    while True:
        best, best_c = None, cur_c
        for vi in range(5):
            for q in tables[vi][cur[vi + 1]]:
                if q >= 0:
                    cand = cur[:vi + 1] + (q,) + cur[vi + 2:]
                    c = ev.penalised(cand)
                    if c < best_c:
                        best, best_c = cand, c
        for e in range(_MOVES):  # joint move on A, C, R, W
            a, c_, r, w = (L.exch["A"][cur[1]][e], L.exch["C"][cur[3]][e], L.exch["R"][cur[4]][e],
                           L.exch["W"][cur[5]][e])
            if min(a, c_, r, w) >= 0:
                cand = (cur[0], a, cur[2], c_, r, w)
                c = ev.penalised(cand)
                if c < best_c:
                    best, best_c = cand, c
        if best is None and pairs:
            for vi in range(5):
                for vj in range(vi + 1, 5):
                    for q in tables[vi][cur[vi + 1]]:
                        for r in tables[vj][cur[vj + 1]]:
                            if q >= 0 and r >= 0:
                                cand = list(cur)
                                cand[vi + 1], cand[vj + 1] = q, r
                                cand = tuple(cand)
                                c = ev.penalised(cand)
                                if c < best_c:
                                    best, best_c = cand, c
        if best is None:
            return cur
        cur, cur_c = best, best_c


def similarity_search(job: PPOJob, refine: int = 3) -> SearchResult:
    """PUZZLE §5.3: start from each stage's individually best plans and move to similar plans
    while the Eq. (2) total of the whole iteration decreases; several starting points per layout;
    the ``refine`` best end points are polished with two-model moves."""
    t0 = time.perf_counter()
    ev = _Evaluator(job)
    ends = {}
    for L in ev.layouts:
        if L.ok:
            for start in _starting_points(ev, L):
                cfg = _descend(ev, start)
                ends[cfg] = ev.penalised(cfg)
    best, best_c = None, math.inf
    for cfg in sorted(ends, key=ends.get)[:refine]:
        cfg = _descend(ev, cfg, pairs=True)
        c = ev.penalised(cfg)
        if c < best_c:
            best, best_c = cfg, c
    if best is None or ev.evaluate(best)[1] > 0:
        raise ev.infeasible()
    return ev.result(best, "similarity", time.perf_counter() - t0)


# ---- exhaustive search (branch and bound, exact) -------------------------------------------------
def exhaustive_search(job: PPOJob) -> SearchResult:
    """Minimum of the same objective over the whole space. Pruning is exact: a partial sum plus
    lower bounds of the rest (pipelined work without bubbles; the fastest generation + switch)
    that already reaches the best total found cannot win; a configuration whose memory without
    the generation stage overflows overflows with every generation plan."""
    t0 = time.perf_counter()
    ev = _Evaluator(job)
    best, best_c = None, math.inf
    for L in ev.layouts:
        if not L.ok:
            continue
        li, disjoint = L.li, L.k is not None
        nA, nG, nC, nR, nW = (len(L.plans[v]) for v in VARS)
        gen_sorted = [sorted((ev.gen_switch(li, a, g), g) for g in range(nG)) for a in range(nA)]
        min_r = min(t.work for t in L.task["R"])
        min_w = min(t.work for t in L.task["W"])
        for a in range(nA):
            gA = gen_sorted[a]
            g_lb = gA[0][0]
            a_fwd = L.fwd["A"][a].work if ev.w.actor_logprobs_in_scoring else 0.0
            for c in range(nC):
                tr = ev.train_time(li, a, c)[0]
                c_fwd = L.fwd["C"][c].work
                s_ac, a_ac = L.smax["A"][a] + L.smax["C"][c], max(L.amax["A"][a], L.amax["C"][c])
                lb = max(a_fwd + min_r, c_fwd + min_w) if disjoint else a_fwd + min_r + c_fwd + min_w
                if tr + lb + g_lb >= best_c:
                    continue
                for r in range(nR):
                    for w in range(nW):
                        base_t = tr + ev.score_time(li, a, c, r, w)[0] + ev.offload_time(li, a, c, r, w)
                        if base_t + g_lb >= best_c:
                            continue
                        bound = s_ac + L.smax["R"][r] + L.smax["W"][w] + max(a_ac, L.amax["R"][r], L.amax["W"][w])
                        if bound > ev.usable and max(map(operator.add, *ev.base_memory(li, a, c, r, w))) > ev.usable:
                            # the memory without the generation stage already overflows: no G helps
                            cfg = (li, a, gA[0][1], c, r, w)
                            ev.n_evals += 1
                            ev.reject(ev.overflow(cfg), cfg)
                            continue
                        for gs, g in gA:
                            if base_t + gs >= best_c:
                                break
                            cfg = (li, a, g, c, r, w)
                            ev.n_evals += 1
                            ov = ev.overflow(cfg)
                            if ov <= 0:
                                best, best_c = cfg, base_t + gs
                                break
                            ev.reject(ov, cfg)
    if best is None:
        raise ev.infeasible()
    return ev.result(best, "exhaustive", time.perf_counter() - t0)
