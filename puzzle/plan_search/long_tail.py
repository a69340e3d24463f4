"""The long tail of generation, priced from a response-length distribution (issue #36, item 4).

A synchronous generation stage lasts as long as its longest response: continuous batching
refills the KV-cache slots while prompts wait, but once none wait the rows thin out and the stage
ends on its tail. Each decode step costs (per the profile, :meth:`CostModel.decode_step_seconds`)
by its width: puzzle/rollout/generation.py computes slots 0..n-1, n = 1 + the highest slot still
generating, so finished rows below a live one still cost. Three ways to run an iteration are weighed:

* ``sync``: colocated-synchronous (the PUZZLE placements, today's run): generation of the whole
  batch, its tail included, then scoring and training on the same ranks.
* ``partial``: colocated with partial rollouts (``--rl-partial-rollouts``, over-sampling F): each
  iteration serves ceil(F x G) groups, carried ones first, stops at the quota of G whole finished
  groups and carries the rest; a carried sample resumes by a prefill of prompt + partial response
  (priced), and its tokens generated before count in the iteration that generated them. The actor
  generates in one share at P=1 (what the run requires), with F x more rows in its KV cache.
* ``overlap``: disjoint-asynchronous, lag 1 (``--rl-desired-lag 1``): G ranks generate batch k+1
  while the other W ranks score and train batch k; an iteration lasts
  ``max(generation on G ranks, scoring + training on W ranks) + the switch`` (the new weights
  from the training layout to the generation pool, every byte of it: the pools share no rank;
  taken as exposed). On a CPU host whose ranks share cores (the profile's ``host_cores``) the
  longer pool's work beyond the shorter one's runs at :meth:`Profile.busy_ranks_factor` of its
  pool (its ranks get the cores the waiting pool leaves). Every split G + W = N whose two pools
  fit memory is priced: the training pool's plans are the plan search's for W ranks (whose
  objective and memory still count a generation stage of its own there: conservative), the
  generation pool's the fastest generation plan of the actor alone on G ranks that fits; or the
  run's own pools (:meth:`LongTailPricer.overlap_at`, what puzzle.bench.long_tail runs).

The steps' widths come from a deterministic simulation (:func:`simulate`): seeded draws from
the distribution, continuous batching over the slots in serving order, the quota rule of
puzzle/dataflow/partial_stage.py, some warm-up iterations (the carried buffer fills), then the mean
of the measured ones. Scoring and training are priced at the mean length of the responses an
iteration trains. The choice (:func:`choose`) is advisory: it is printed by ``--dry-run`` and
search_plan.py and returned, but the run's own flags decide what runs. A mode other than ``sync``
is chosen only when it is at least :data:`OFF_POLICY_MARGIN` faster: its samples are stale by one
policy version or more, which costs learning the estimate does not see.
"""

from __future__ import annotations

import heapq
import json
import math
import random
from collections import Counter, deque
from dataclasses import dataclass, field, replace
from statistics import NormalDist
from typing import Dict, List, Optional, Sequence, Tuple

from puzzle.parallel.plan import ParallelPlan
from puzzle.plan_search.cost_model import CostModel, ModelRole, PPOWorkload, ppo_roles, stage_seconds
from puzzle.plan_search.memory_model import MemoryModel, fmt_plan
from puzzle.plan_search.profile_data import load_profile
from puzzle.plan_search.search import InfeasibleError, PPOJob, candidate_plans, similarity_search

#: a mode other than synchronous must be at least this much faster (fraction of sync's time)
OFF_POLICY_MARGIN = 0.05
_STANDARD_NORMAL = NormalDist()
#: normal quantile of 0.99 (a log-normal's p99 = p50 * exp(sigma * Z99))
Z99 = _STANDARD_NORMAL.inv_cdf(0.99)
MODE_LABELS = {"sync": "colocated synchronous", "partial": "colocated, partial rollouts",
               "overlap": "disjoint asynchronous, lag 1"}


# ---- the distribution --------------------------------------------------------------------------
@dataclass(frozen=True)
class ResponseLengths:
    """Response lengths in tokens, each in [1, ``cap``] (--max-new-tokens). ``kind``:

    * ``fixed``: every response at ``cap`` (what the stage costs without a distribution);
    * ``lognormal``: median ``p50``, 99th percentile ``p99`` (the flags
      --expected-response-length-p50/-p99; ``p50 == p99``: every response at p50);
    * ``exponential``: mean ``mean`` (puzzle.bench.packing's long tail);
    * ``measured``: piecewise linear through ``points`` (quantile, length), e.g. a run's logged
      response_length_p10/p50/p90/max (:func:`from_metrics`).

    ``cap_every`` k > 0: besides, the samples of global index 0, k, 2k, ... run to the cap (a
    rollout's response truncated at --max-new-tokens, as puzzle.bench.packing draws its long tail:
    the first row of each rollout of k samples at the cap); 0: none."""

    kind: str
    cap: int
    p50: float = 0.0
    p99: float = 0.0
    mean: float = 0.0
    points: Tuple[Tuple[float, float], ...] = ()
    cap_every: int = 0

    def __post_init__(self):
        if not isinstance(self.cap, int) or self.cap < 1:
            raise ValueError(f"response lengths: max_new_tokens must be a positive integer (got {self.cap!r})")
        if self.kind == "lognormal":
            check_percentiles(self.p50, self.p99, self.cap)
        elif self.kind == "exponential" and not self.mean > 0:
            raise ValueError(f"response lengths: an exponential distribution needs a mean > 0 (got {self.mean})")
        elif self.kind == "measured" and (len(self.points) < 2 or any(
                b[0] <= a[0] or b[1] < a[1] for a, b in zip(self.points, self.points[1:]))):
            raise ValueError("response lengths: measured points must rise in quantile and not fall in length")
        elif self.kind not in ("fixed", "lognormal", "exponential", "measured"):
            raise ValueError(f"response lengths: unknown kind {self.kind!r}")
        if isinstance(self.cap_every, bool) or not isinstance(self.cap_every, int) or self.cap_every < 0:
            raise ValueError(f"response lengths: cap_every must be an integer >= 0 (got {self.cap_every!r})")

    @classmethod
    def from_percentiles(cls, p50: float, p99: float, cap: int) -> "ResponseLengths":
        return cls("lognormal", cap, p50=p50, p99=p99)

    def quantile(self, u: float) -> int:
        """The length at quantile ``u`` in (0, 1), capped to [1, cap]."""
        if self.kind == "fixed":
            x = float(self.cap)
        elif self.kind == "lognormal":
            sigma = math.log(self.p99 / self.p50) / Z99
            x = self.p50 * math.exp(sigma * _STANDARD_NORMAL.inv_cdf(u))
        elif self.kind == "exponential":
            x = -self.mean * math.log(1.0 - u)
        else:
            pts = self.points
            x = pts[-1][1]
            for (u0, x0), (u1, x1) in zip(pts, pts[1:]):
                if u <= u1:
                    x = x0 + (x1 - x0) * (max(u, u0) - u0) / (u1 - u0)
                    break
        return max(1, min(self.cap, int(x)))

    def length_of(self, sample: int, u: float) -> int:
        """The length of the sample of global index ``sample`` drawn at quantile ``u``."""
        return self.cap if self.cap_every and sample % self.cap_every == 0 else self.quantile(u)

    def expected_mean(self, n: int = 4096) -> float:
        drawn = sum(self.quantile((i + 0.5) / n) for i in range(n)) / n
        return drawn + (self.cap - drawn) / self.cap_every if self.cap_every else drawn

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"every response at --max-new-tokens {self.cap}"
        if self.kind == "lognormal":
            text = f"log-normal, p50 {self.p50:g}, p99 {self.p99:g} of {self.cap} tokens"
        elif self.kind == "exponential":
            text = f"exponential, mean {self.mean:g}, capped at {self.cap} tokens"
        else:
            text = "measured (" + ", ".join(f"p{round(100 * u)} {x:g}" for u, x in self.points) + f") of {self.cap} tokens"
        return text + (f", 1 in {self.cap_every} samples (the first of each rollout) at the cap" if self.cap_every
                       else "")


def check_percentiles(p50, p99, cap: int, names=("p50", "p99", "max_new_tokens")) -> None:
    """ValueError naming the problem unless 0 < p50 <= p99 <= cap (``names``: how to call them)."""
    for v, n in ((p50, names[0]), (p99, names[1])):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"{n}: must be a positive number of tokens (got {v!r})")
    if p50 > p99:
        raise ValueError(f"{names[0]}: must be <= {names[1]} (got {p50} > {p99})")
    if p99 > cap:
        raise ValueError(f"{names[1]}: must be <= {names[2]} {cap} (got {p99})")


#: the length percentiles the generation stage logs per iteration (puzzle/dataflow/generation_stage.py)
METRIC_QUANTILES = (("response_length_p10", 0.1), ("response_length_p50", 0.5), ("response_length_p90", 0.9),
                    ("response_length_max", 1.0))


def from_metrics(path: str, cap: int, last: int = 5) -> ResponseLengths:
    """The distribution of a run's last ``last`` logged iterations (its metrics.jsonl): the median
    over them of each logged percentile, linear between them (from length 1 at quantile 0)."""
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                row = json.loads(line)
                if all(k in row for k, _ in METRIC_QUANTILES):
                    rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no iteration with response_length_p10/p50/p90/max")
    rows = rows[-last:]
    pts = [(0.0, 1.0)]
    for key, u in METRIC_QUANTILES:
        vals = sorted(float(r[key]) for r in rows)
        pts.append((u, max(pts[-1][1], min(float(cap), vals[len(vals) // 2]))))
    return ResponseLengths("measured", cap, points=tuple(pts))


# ---- the simulation of the generation stage ----------------------------------------------------
@dataclass
class Trace:
    """One generation call (one replica, one iteration): decode steps by their width (the rows
    a step computes), the prefill calls (rows, tokens), and the responses the iteration trains."""

    steps: Counter = field(default_factory=Counter)
    prefills: List[Tuple[int, int]] = field(default_factory=list)
    trained_tokens: int = 0
    trained: int = 0
    carried_tokens: int = 0  # tokens of carried samples prefilled again on resume


class _Row:
    __slots__ = ("target", "done", "group", "start", "finished")

    def __init__(self, target: int, group: int):
        self.target, self.done, self.group, self.start, self.finished = target, 0, group, 0, False


def _generate(rows: List[_Row], slots: int, needed: Optional[int], prompt_len: int, tr: Trace) -> None:
    """Continuous batching of ``rows`` (serving order) over ``slots`` KV-cache slots as
    puzzle/rollout/generation.py runs it (a finished row's slot goes to the next waiting row, the
    lowest free slot first; a decode step computes slots 0..n-1, n = 1 + the highest slot still
    generating: its width) until every row has finished or ``needed`` groups of these rows have;
    advances each row's ``done`` and records the steps by width."""
    left = Counter(r.group for r in rows)
    queue, live, complete, t = deque(rows), [], 0, 0
    free = list(range(slots))  # a min-heap of free slots
    high: List[int] = []       # a max-heap (negated) of busy slots, stale entries skipped
    busy = set()

    def start(now: int) -> None:
        batch = []
        while queue and free:
            batch.append((queue.popleft(), heapq.heappop(free)))
        if batch:
            tr.prefills.append((len(batch), sum(prompt_len + r.done for r, _ in batch)))
            tr.carried_tokens += sum(r.done for r, _ in batch)
        for r, slot in batch:  # the prefill samples the first new token
            r.start, r.done = now, r.done + 1
            busy.add(slot)
            heapq.heappush(high, -slot)
            heapq.heappush(live, (now + r.target - r.done, slot, r))

    start(0)
    while live:
        end = live[0][0]
        if end > t:
            while -high[0] not in busy:
                heapq.heappop(high)
            tr.steps[1 - high[0]] += end - t
            t = end
        while live and live[0][0] == t:
            _, slot, r = heapq.heappop(live)
            r.done, r.finished = r.target, True
            busy.discard(slot)
            heapq.heappush(free, slot)
            left[r.group] -= 1
            complete += left[r.group] == 0
        if needed is not None and complete >= needed:
            break
        start(t)
    for _, _, r in live:  # stopped at the quota: tokens so far
        r.done += t - r.start


def simulate(lengths: ResponseLengths, groups: int, group_size: int, *, slots: Optional[int] = None,
             oversample: Optional[float] = None, prompt_len: int = 1, iterations: int = 12, warmup: int = 4,
             seed: int = 0, replica: Tuple[int, int] = (0, 1)) -> List[Trace]:
    """Traces of the measured iterations of one generation replica serving ``groups`` groups of
    ``group_size`` per iteration: synchronous (``oversample`` None: every served row finishes) or
    with partial rollouts (serve ceil(oversample x groups) groups, carried first, stop at the quota
    of ``groups`` whole finished groups, carry the rest). ``slots``: KV-cache rows (None: all).
    ``replica`` (d, D): this one is replica d of D, each serving ``groups`` of an iteration's
    groups in turn (the global sample indices :meth:`ResponseLengths.length_of` keys on)."""
    d, D = replica

    def group_of(serial: int) -> List[_Row]:
        first = ((serial // groups) * groups * D + d * groups + serial % groups) * group_size
        return [_Row(lengths.length_of(first + j, rng.random()), serial) for j in range(group_size)]

    rng = random.Random(seed)
    buffer: List[List[_Row]] = []
    serial = 0
    out = []
    want = groups if oversample is None else max(groups, math.ceil(oversample * groups))
    warmup = 0 if oversample is None else warmup  # synchronous iterations carry nothing
    for it in range(warmup + iterations):
        tr = Trace()
        served, buffer = buffer[:want], buffer[want:]
        while len(served) < want:
            served.append(group_of(serial))
            serial += 1
        done_before = sum(all(r.finished for r in g) for g in served)
        todo = [r for g in served for r in g if not r.finished]
        if todo and groups > done_before:
            n_slots = slots or len(todo)
            _generate(todo, n_slots, None if oversample is None else groups - done_before, prompt_len, tr)
        complete = [g for g in served if all(r.finished for r in g)][:groups]
        taken = {id(g) for g in complete}
        buffer += [g for g in served if id(g) not in taken]
        tr.trained = sum(len(g) for g in complete)
        tr.trained_tokens = sum(r.target for g in complete for r in g)
        if it >= warmup:
            out.append(tr)
    return out


# ---- pricing -----------------------------------------------------------------------------------
def trace_seconds(cm: CostModel, role: ModelRole, plan: ParallelPlan, tr: Trace) -> float:
    """Seconds of one traced generation call on ``plan``: every decode step at its width, every
    prefill at its rows and tokens. P > 1 (synchronous only): the plan's whole-batch estimate
    with its decode steps cut to the trace's longest response."""
    if plan.P == 1:
        return (sum(n * cm.decode_step_seconds(role, plan, live) for live, n in tr.steps.items())
                + sum(cm.prefill_seconds(role, plan, rows, tokens) for rows, tokens in tr.prefills))
    full = cm.generation_cost(role, plan)
    steps = sum(tr.steps.values())
    return full.extra + (full.total - full.extra) * steps / max(1, cm.workload.gen_len - 1)


@dataclass
class ModeEstimate:
    """One way to run an iteration: its estimated seconds and what they are made of."""

    mode: str
    iteration_s: float = math.inf
    generation_s: float = 0.0
    train_side_s: float = 0.0  # scoring + training (+ the colocated switch)
    switch_s: float = 0.0      # the actor's switch to its generation layout (the overlap's: to the other pool)
    layout: str = ""
    flags: str = ""
    why_not: str = ""          # empty: available

    @property
    def available(self) -> bool:
        return not self.why_not

    def to_dict(self) -> dict:
        d = {"mode": self.mode, "label": MODE_LABELS[self.mode], "available": self.available}
        if self.available:
            d.update(iteration_s=round(self.iteration_s, 6), generation_s=round(self.generation_s, 6),
                     train_side_s=round(self.train_side_s, 6), switch_s=round(self.switch_s, 6),
                     layout=self.layout, flags=self.flags)
        else:
            d["why_not"] = self.why_not
        return d


@dataclass
class LongTailReport:
    lengths: ResponseLengths
    estimates: List[ModeEstimate]
    choice: str

    def estimate(self, mode: str) -> ModeEstimate:
        return next(e for e in self.estimates if e.mode == mode)

    def to_dict(self) -> dict:
        return {"response_lengths": self.lengths.describe(), "choice": self.choice, "advisory": True,
                "modes": [e.to_dict() for e in self.estimates]}

    def lines(self) -> List[str]:
        out = [f"long tail (responses: {self.lengths.describe()}); estimated seconds per iteration:",
               f"  {'mode':31s} {'iteration':>9s} {'generate':>9s} {'score+train':>11s} {'switch':>7s}  layouts"]
        for e in self.estimates:
            label = MODE_LABELS[e.mode]
            if e.available:
                out.append(f"  {label:31s} {e.iteration_s:9.3f} {e.generation_s:9.3f} {e.train_side_s:11.3f} "
                           f"{e.switch_s:7.3f}  {e.layout}")
            else:
                out.append(f"  {label:31s} {'-':>9s}  ({e.why_not})")
        best = self.estimate(self.choice)
        out.append(f"choice: {MODE_LABELS[self.choice]}" + (f" ({best.flags})" if best.flags else "")
                   + "; advisory only: this run's own flags decide what runs")
        return out


def choose(estimates: List[ModeEstimate], margin: float = OFF_POLICY_MARGIN) -> str:
    """The fastest available mode; another than ``sync`` only when it is at least ``margin``
    (a fraction of sync's time) faster."""
    sync = next(e for e in estimates if e.mode == "sync")
    best = min((e for e in estimates if e.available), key=lambda e: e.iteration_s)
    return best.mode if best.iteration_s < (1.0 - margin) * sync.iteration_s else "sync"


class LongTailPricer:
    """Prices the three modes of one job (:func:`compare_modes`); simulations are cached."""

    def __init__(self, job: PPOJob, lengths: ResponseLengths, group_size: int, oversample: float):
        if not isinstance(group_size, int) or group_size < 1 or job.workload.rollout_batch_size % group_size:
            raise ValueError(f"group_size must divide the {job.workload.rollout_batch_size} samples (got {group_size!r})")
        if not oversample >= 1:
            raise ValueError(f"oversample: must be >= 1 (got {oversample})")
        if lengths.cap != job.workload.gen_len:
            raise ValueError(f"response lengths capped at {lengths.cap}, the workload generates {job.workload.gen_len}")
        self.lengths, self.N, self.F = lengths, group_size, oversample
        self.w: PPOWorkload = job.workload
        self.profile = job.profile or load_profile("a100_80gb")
        self.job = replace(job, profile=self.profile)
        self.roles = ppo_roles_of(job)
        self.actor = self.roles["actor"]
        self.G = self.w.rollout_batch_size // group_size  # prompts per batch
        self.mean = lengths.expected_mean()
        self._sims: Dict[tuple, List[Trace]] = {}

    def _simulate(self, groups: int, group_size: int, oversample: Optional[float],
                  replica: Tuple[int, int] = (0, 1)) -> List[Trace]:
        fixed = self.lengths.kind == "fixed"  # no draws: one replica and a short cycle stand for all
        replica = (0, 1) if fixed else replica
        key = (groups, group_size, oversample, replica)
        if key not in self._sims:
            rounds = dict(iterations=2, warmup=2) if fixed else {}
            self._sims[key] = simulate(self.lengths, groups, group_size, slots=self.w.generation_micro_batch_size,
                                       oversample=oversample, prompt_len=self.w.prompt_len, seed=replica[0],
                                       replica=replica, **rounds)
        return self._sims[key]

    def _cost_model(self, mean_len: float) -> CostModel:
        return CostModel(self.profile, replace(self.w, mean_gen_len=mean_len))

    def sync_generation(self, cm: CostModel, plan: ParallelPlan) -> float:
        """Mean over the simulated iterations of the slowest replica's generation (each replica
        its share of the batch, its own tail)."""
        b = math.ceil(self.w.rollout_batch_size / plan.D)
        per = [self._simulate(b, 1, None, replica=(d, plan.D)) for d in range(plan.D)]
        its = len(per[0])
        return sum(max(trace_seconds(cm, self.actor, plan, per[d][i]) for d in range(plan.D))
                   for i in range(its)) / its

    def sync(self, plans, placements) -> ModeEstimate:
        cm = self._cost_model(self.mean)
        gen_plan = plans["actor"]["generation"]
        gen = self.sync_generation(cm, gen_plan)
        side, switch = self._train_side(cm, plans, placements)
        return ModeEstimate("sync", gen + side + switch, gen, side, switch, layout=_layout(plans))

    def _train_side(self, cm: CostModel, plans, placements) -> Tuple[float, float]:
        """(scoring + training seconds, the actor's switch to its generation layout)."""
        st = stage_seconds(cm, self.roles, plans, placements)
        A = plans["actor"]["training"]
        switch = cm.switch(self.actor, A, plans["actor"].get("generation", A))[1]
        return st["scoring"] + st["training"] - switch, switch

    def partial(self, plans, placements) -> ModeEstimate:
        N, G, F, w = self.N, self.G, self.F, self.w
        served = replace(w, rollout_batch_size=max(G, math.ceil(F * G)) * N)
        flags = f"--rl-partial-rollouts --rl-partial-rollouts-oversample {F:g} --rl-inference-logprobs-is-correction"
        gen_plan = plans["actor"]["generation"]
        if gen_plan.P != 1 or gen_plan.generation_share(0)[1] != 1:
            options, _ = candidate_plans(self.actor.shape, self.job.world_size, 0, served, "generation",
                                         self.profile.ranks_per_node)
            options = [q for q in options if q.P == 1 and q.generation_share(0)[1] == 1]
            if not options:
                return ModeEstimate("partial", flags=flags, why_not=f"no generation layout at P=1 in one share on "
                                                                    f"{self.job.world_size} ranks")
            gen_plan = options[0]
            flags += " --actor-gen-tensor-model-parallel-size " + str(gen_plan.T)
        plans = {m: dict(st) for m, st in plans.items()}
        plans["actor"]["generation"] = gen_plan
        mem = MemoryModel(self.profile, served)
        shadow = gen_plan != plans["actor"]["training"]
        worst = max((mem.rank_report(r, plans, self.roles, shadow) for r in range(self.job.world_size)),
                    key=lambda rep: rep.total)
        if not worst.fits:
            return ModeEstimate("partial", flags=flags, why_not="does not fit: " + worst.describe())
        traces = self._simulate(G, N, F)
        trained_mean = sum(t.trained_tokens for t in traces) / sum(t.trained for t in traces)
        cm = self._cost_model(trained_mean)
        gen = sum(trace_seconds(cm, self.actor, gen_plan, t) for t in traces) / len(traces)
        side, switch = self._train_side(cm, plans, placements)
        return ModeEstimate("partial", gen + side + switch, gen, side, switch, _layout(plans), flags)

    def overlap_split(self, n_gen: int) -> ModeEstimate:
        """The lag-1 overlap with ``n_gen`` generation ranks after the training pool's ranks: the
        training pool's plans searched, the generation pool's fastest plan that fits."""
        N, w = self.job.world_size, self.w
        n_train = N - n_gen
        flags = f"--rl-desired-lag 1, {n_gen} generation + {n_train} training ranks"
        try:
            pool = similarity_search(replace(self.job, world_size=n_train))
        except InfeasibleError as e:
            return ModeEstimate("overlap", flags=flags, why_not=f"training pool of {n_train}: "
                                                                 + str(e).splitlines()[0])
        plans = {m: {s: q for s, q in st.items() if not (m == "actor" and s == "generation")}
                 for m, st in pool.plans.items()}
        cm = self._cost_model(self.mean)
        options, _ = candidate_plans(self.actor.shape, n_gen, n_train, w, "generation", self.profile.ranks_per_node)
        mem = MemoryModel(self.profile, w)
        options = [q for q in options if mem.model_alone(self.actor, q, "generation").fits]
        if not options:
            return ModeEstimate("overlap", flags=flags, why_not=f"no generation layout fits {n_gen} ranks")
        _, gen_plan = min((self.sync_generation(cm, q), q) for q in options)
        return self.overlap_at(plans, pool.placements, gen_plan, flags)

    def overlap_at(self, plans, placements, gen_plan: ParallelPlan, flags: str = "") -> ModeEstimate:
        """The lag-1 overlap at given layouts: the training pool's ``plans`` / ``placements`` (no
        actor generation plan among them) and the generation pool's ``gen_plan`` on the ranks
        after them (its offset). The pools work at once while both have work; on a CPU host whose
        ranks share cores, the pool still working once the other waits runs faster
        (:meth:`Profile.busy_ranks_factor`): its rest of the work at that factor."""
        n_train, n_gen = gen_plan.offset, gen_plan.size
        flags = flags or f"--rl-desired-lag 1, {n_gen} generation + {n_train} training ranks"
        if not MemoryModel(self.profile, self.w).model_alone(self.actor, gen_plan, "generation").fits:
            return ModeEstimate("overlap", flags=flags, why_not=f"generation {fmt_plan(gen_plan)} does not fit")
        cm = self._cost_model(self.mean)
        side, _ = self._train_side(cm, plans, placements)
        gen = self.sync_generation(cm, gen_plan)
        switch = cm.switch(self.actor, plans["actor"]["training"], gen_plan)[1]
        both = min(gen, side)  # both pools busy
        factor = self.profile.busy_ranks_factor
        rest = (gen - both) * factor(n_gen) + (side - both) * factor(n_train)
        last = n_train + n_gen - 1
        layout = f"generation {fmt_plan(gen_plan)} on ranks {n_train}..{last}; training pool " + _layout(plans)
        return ModeEstimate("overlap", both + rest + switch, gen, side, switch, layout, flags)

    def overlap(self, gen_ranks: Optional[Sequence[int]] = None) -> ModeEstimate:
        """The fastest split that fits, over ``gen_ranks`` generation ranks (None: every split)."""
        N = self.job.world_size
        if N < 2:
            return ModeEstimate("overlap", why_not="needs >= 2 ranks (a generation and a training pool)")
        splits = [self.overlap_split(g) for g in (gen_ranks or range(1, N))]
        ok = [e for e in splits if e.available]
        if ok:
            return min(ok, key=lambda e: e.iteration_s)
        even = splits[(len(splits) - 1) // 2]  # the middle split's reason stands for all
        return replace(even, why_not=f"no split of the {N} ranks fits; e.g. {even.flags.split(', ')[1]}: "
                                     + even.why_not)


def ppo_roles_of(job: PPOJob) -> Dict[str, ModelRole]:
    roles = ppo_roles(job.actor, job.critic, job.ref, job.reward)
    return {r: roles[r] for r in job.roles}


def _layout(plans) -> str:
    return ", ".join(f"{m} {fmt_plan(st['training'] if 'training' in st else st['scoring'])}"
                     + (f" gen {fmt_plan(st['generation'])}" if 'generation' in st else "") for m, st in plans.items())


def coarse_splits(world: int) -> List[int]:
    """Generation pools of a quarter, half and three quarters of the ranks (what --dry-run prices;
    search_plan.py prices every split)."""
    return sorted({min(world - 1, max(1, round(world * f))) for f in (0.25, 0.5, 0.75)}) if world > 1 else []


def compare_modes(job: PPOJob, lengths: ResponseLengths, group_size: int, oversample: float,
                  plans: Optional[dict] = None, placements: Optional[dict] = None,
                  margin: float = OFF_POLICY_MARGIN, gen_ranks: Optional[Sequence[int]] = None,
                  partial_refused: str = "", partial_layouts: Optional[tuple] = None,
                  overlap_layouts: Optional[tuple] = None) -> LongTailReport:
    """The three modes of ``job`` priced under ``lengths`` and the advisory choice. ``plans`` /
    ``placements``: the colocated modes' layouts (the run's own for --dry-run); None: searched.
    ``gen_ranks``: the overlap's generation pool sizes to price (None: every split).
    ``partial_refused``: why the run cannot take partial rollouts (its estimator, ...), if so.
    The layouts a run of each mode has (what puzzle.bench.long_tail runs): ``partial_layouts``
    (plans, placements) for partial rollouts (default ``plans``); ``overlap_layouts`` (the
    training pool's plans, placements, the generation pool's plan) for the overlap instead of
    the splits of ``gen_ranks``."""
    pricer = LongTailPricer(job, lengths, group_size, oversample)
    if plans is None:
        found = similarity_search(job)
        plans, placements = found.plans, found.placements
    partial = (ModeEstimate("partial", why_not=partial_refused) if partial_refused
               else pricer.partial(*(partial_layouts or (plans, placements))))
    overlap = pricer.overlap_at(*overlap_layouts) if overlap_layouts else pricer.overlap(gen_ranks)
    estimates = [pricer.sync(plans, placements), partial, overlap]
    return LongTailReport(lengths, estimates, choose(estimates, margin))
