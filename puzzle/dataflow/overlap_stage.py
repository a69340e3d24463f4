"""One-step off-policy overlap (--rl-desired-lag L): a generation pool and a training pool.

The actor's generation layout sits on ranks of its own (--actor-gen-rank-offset, on ranks no
training role uses); the training roles (actor, critic, ref, reward model: time-shared among
themselves as always) on the ranks before it. Versions: version v is the actor's weights after v
optimizer steps (0: the initial weights); iteration k trains batch k, so its step makes version k.

**The schedule.** Batch k (k = 1..N, N = --train-iters) is generated with version
``max(0, k - 1 - L)``: L = 0 is the synchronous run (batch k with the weights of step k - 1).
The run is N + L rounds (``round_work``); in round r the generation pool generates batch r
(r <= N) while the training pool rewards, scores and trains batch r - L (r > L). At the round's end
the training pool's step r - L sends version r - L to the generation pool (the switch, overlapped
with the optimizer step, moving only the bytes each generation rank lacks) when a later batch is
generated with it (r + 1 <= N), and batch r goes from the generation pool's first rank to every
training rank (point to point). With L >= 1 the weights move first, then the batch (the generation
pool posts its receives of the weights before it blocks on the batch); with L = 0 the batch moves in
the middle of the round. Nothing is generated that is not trained (the last L rounds only train).

**Collectives.** Each pool's own work runs in ``collective_scope`` of the pool
(puzzle/parallel/scope.py): the generation gathers its rows within the generation pool, rewards,
scoring and training reduce within the training pool. Only the switch and the batch (point to
point) and the exit check at each round's end (one small all-reduce) span both pools.

**Prompts.** Both pools draw the same prompt loader in the same order: batch k is the k-th draw on
either side, so nothing is lost or duplicated and the order is the synchronous run's.

Each trained token's policy version (the version the generation pool holds, set by each switch it
receives) and its behaviour log-prob (``gen_logprobs``, as sampled) reach the training pool with
the batch; the actor's loss takes the behaviour log-probs through --rl-inference-logprobs-is-correction.

**Checkpoints.** A save after iteration k (round k + L) holds the batches in flight, k+1 .. k+L
(``InFlight``: the training pool takes them from the sends first). A run resumed at iteration k
(``start``) with m of them trains them first: its rounds begin at ``first_round(k, m)`` and are
the uninterrupted run's; without any (a synchronous run's checkpoint) its first L rounds fill the
pipeline from the checkpoint's weights, as a fresh run's do from the initial ones.

**Evaluation** of iteration k: the step's switch sends version k (also in the last L rounds, where
no later batch needs it), the generation pool generates the eval prompts after the round's batch
and sends them (``EVAL_TAG``), the training pool scores them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from puzzle.dataflow.batch import RolloutBatch
from puzzle.parallel.scope import Scope


@dataclass(frozen=True)
class RoundWork:
    """What each pool does in one round (see the module doc)."""

    round: int
    generate: Optional[int]   # the batch the generation pool generates (None: none)
    version: int              # ... with this policy version
    train: Optional[int]      # the batch the training pool trains (None: none)
    send_weights: bool        # the training step's new version goes to the generation pool


def generation_version(batch: int, lag: int, start: int = 0) -> int:
    """The policy version batch ``batch`` (1-based) is generated with (``start``: the iteration the
    run started or resumed at; no version before it is at hand)."""
    return max(start, batch - 1 - lag)


def num_rounds(iterations: int, lag: int) -> int:
    return iterations + lag


def round_work(r: int, iterations: int, lag: int, start: int = 0) -> RoundWork:
    """Round ``r`` (1-based) of a run of ``iterations`` batches at lag ``lag`` that started (or
    resumed) at iteration ``start``: it trains batch ``r - lag`` only when that batch is after
    ``start`` (a resumed run's first rounds after a checkpoint without batches in flight fill the
    pipeline as a fresh run's do)."""
    if lag < 0 or not 1 <= r <= num_rounds(iterations, lag) or not 0 <= start <= iterations:
        raise ValueError(f"round {r} of a {iterations}-iteration run at lag {lag} started at iteration {start}")
    gen = r if r <= iterations else None
    train = r - lag if r - lag > start else None
    return RoundWork(r, gen, generation_version(gen, lag, start) if gen else -1, train,
                     train is not None and r + 1 <= iterations)


def first_round(start: int, in_flight: int) -> int:
    """The first round of a run resumed at iteration ``start`` with ``in_flight`` batches generated
    before the checkpoint (batches start + 1 .. start + in_flight): the one that generates the next."""
    return start + in_flight + 1


class Pools:
    """The two pools' ranks and groups (collective: every rank creates both groups)."""

    def __init__(self, train_ranks: List[int], gen_ranks: List[int]):
        from puzzle.parallel.device import runtime

        timeout = runtime().timeout
        self.train_ranks, self.gen_ranks = list(train_ranks), list(gen_ranks)
        me = dist.get_rank()
        scopes = []
        for ranks in (self.train_ranks, self.gen_ranks):
            group = dist.new_group(ranks=ranks, timeout=timeout)
            objects = dist.new_group(ranks=ranks, timeout=timeout, backend="gloo")
            scopes.append(Scope(tuple(ranks), group, objects) if me in ranks else None)
        self.train, self.gen = scopes
        self.is_generation = me in self.gen_ranks
        self.leader = self.gen_ranks[0]  # sends each batch to every training rank


def pools_of(cfg) -> Optional[Tuple[List[int], List[int]]]:
    """(training ranks, generation ranks) when the actor generates on ranks of its own, else None."""
    actor = cfg.roles["actor"]
    gen = actor.gen_plan
    trained = {r for spec in cfg.roles.values() for r in spec.plan.ranks}
    if gen is None or trained & set(gen.ranks):
        return None
    return sorted(trained), list(gen.ranks)


# ---- the switch across pools ----------------------------------------------------------------
def pool_routing_table(actor, gen_plan, ranks_per_node=None):
    """The routing table from the actor's training layout to ``gen_plan`` on the generation
    pool: the table between the same layouts on the training ranks, each destination moved by
    the pools' distance (the generation pool has as many ranks as the actor's training layout)."""
    from puzzle.switch.shadow import routing_table_for

    src = actor.layout.plan
    dtype = actor.config.params_dtype if actor.config is not None else torch.float32
    base = routing_table_for(actor.arch, actor.role, src, replace(gen_plan, offset=src.offset),
                             dtype_bytes=torch.tensor([], dtype=dtype).element_size(),
                             ranks_per_node=ranks_per_node)
    return base.with_destination_moved(gen_plan.offset - src.offset, gen_plan)


class PoolSwitch:
    """ActorSwitch's interface for a generation layout on other ranks (puzzle/dataflow/actor_switch.py).

    Synchronous (``keep`` False): the shadow is built and filled at each switch and released after
    the generation, as ActorSwitch does. Overlapped (``keep`` True): the generation pool keeps its
    shadow; ``start`` fills it with version 0 and ``receive`` (the generation pool's half of the
    training step's switch) writes each new version into it in place; ``version`` counts them."""

    def __init__(self, actor, gen_plan, segments: int = 1, ranks_per_node=None):
        from puzzle.parallel.groups import layout_for

        self.actor, self.gen_plan, self.segments = actor, gen_plan, segments
        self.table = pool_routing_table(actor, gen_plan, ranks_per_node)
        self.shadow = None
        self.last_stats = None
        self.keep = False
        self.send_next = True  # the next optimizer step sends its weights
        self.version = 0
        layout_for(gen_plan)

    def _new_shadow(self):
        from puzzle.switch.shadow import _dtype_flags, build_shadow

        return build_shadow(self.actor.arch, self.actor.role, self.gen_plan, **_dtype_flags(self.actor))

    def _move(self) -> None:
        """The current weights into the shadow (both pools)."""
        from puzzle.models.param_names import table_params
        from puzzle.switch.routing_executor import execute_routing, fast_dispatch

        with fast_dispatch():
            src, dst = table_params(self.actor.module, self.actor.role), self.shadow.params()
        self.last_stats = execute_routing(self.table, src, dst, num_segments=self.segments)

    def start(self, version: int = 0) -> None:
        """Overlapped: the kept shadow with the actor's current weights, policy ``version`` (the
        iteration the run starts or resumes at; collective over both pools)."""
        self.keep = True
        self.shadow = self._new_shadow()
        self._move()
        self.version = version

    def generation_engine(self):
        from types import SimpleNamespace

        if self.shadow is None:
            self.shadow = self._new_shadow()
            self._move()
        m = self.shadow.module
        return SimpleNamespace(module=m, layout=self.shadow.layout, arch=self.actor.arch, role=self.actor.role,
                               config=m.config if m is not None else None, member=m is not None)

    def optimizer_step_and_switch(self) -> dict:
        """The actor's optimizer step, overlapped with the switch of its result to the generation
        pool when ``send_next`` (else the step alone)."""
        from puzzle.switch.overlap import step_and_switch
        from puzzle.switch.routing_executor import fast_dispatch

        if not self.send_next:
            return self.actor.optimizer_step() if self.actor.member else {}
        if self.keep:
            self.send_next = False  # sent (the overlap's rounds set it again)
        else:
            self.release()  # one not used by a generation (a batch in flight trained first)
            self.shadow = self._new_shadow()
        with fast_dispatch():
            dst = self.shadow.params() if self.shadow is not None else {}
        result, self.last_stats = step_and_switch(self.actor, self.table, dst, segments=self.segments)
        return result

    def receive(self, version: int) -> None:
        """The generation pool's half of ``optimizer_step_and_switch`` (it holds no actor weights):
        policy ``version`` (the training step's iteration) into the kept shadow."""
        self.send_next = True
        self.optimizer_step_and_switch()
        self.version = version

    def send_if_pending(self) -> None:
        """The training pool after its iteration: a version still owed to the generation pool (the
        actor's step was skipped: non-finite gradients) goes as it is, unchanged."""
        if self.send_next:
            self._move()
            self.send_next = False

    def reset(self) -> None:
        """After a load (TrainState): as ``release`` (ActorSwitch's also drops a LoRA actor's kept base)."""
        self.release()

    def release(self) -> None:
        if self.shadow is not None and not self.keep:
            self.shadow.release()
            self.shadow = None


# ---- the batch across pools -------------------------------------------------------------------
#: the point-to-point tags of the two streams from the generation pool's first rank: the batches
#: to train, and (--eval-prompts) the evaluation's batches, each in its own order
BATCH_TAG, EVAL_TAG = 0, 1


def send_batch(batch: RolloutBatch, version: int, seconds: float, train_ranks: List[int],
               tag: int = BATCH_TAG) -> list:
    """The generation pool's first rank sends the batch (tokens, lengths, groups, behaviour
    log-probs when it has them), its policy version and its generation seconds to every training
    rank (isend: the works to wait for before the run ends)."""
    B, S = batch.tokens.shape
    R = batch.max_new_tokens
    group = batch.group_index if batch.group_index is not None else torch.arange(B, device=batch.device)
    logprobs = batch.gen_logprobs if batch.gen_logprobs is not None else torch.zeros(B, R)
    head = torch.tensor([B, S, R, version, int(batch.group_index is not None),
                         int(batch.gen_logprobs is not None)], dtype=torch.long)
    ints = torch.cat([batch.tokens, batch.prompt_lengths[:, None], batch.response_lengths[:, None],
                      group[:, None]], 1).long().cpu()
    floats = torch.cat([logprobs.float().reshape(-1).cpu(), torch.tensor([seconds])])
    return [(dist.isend(t, r, tag=tag), t) for r in train_ranks for t in (head, ints, floats)]


def receive_batch(source: int, device: torch.device, tag: int = BATCH_TAG) -> Tuple[RolloutBatch, int, float]:
    """A training rank's side of ``send_batch``: (the batch, its policy version, generation seconds)."""
    head = torch.zeros(6, dtype=torch.long)
    dist.recv(head, source, tag=tag)
    B, S, R, version, grouped, with_logprobs = head.tolist()
    ints = torch.zeros((B, S + 3), dtype=torch.long)
    floats = torch.zeros(B * R + 1)
    dist.recv(ints, source, tag=tag)
    dist.recv(floats, source, tag=tag)
    ints = ints.to(device)
    batch = RolloutBatch(ints[:, :S].contiguous(), ints[:, S].contiguous(), ints[:, S + 1].contiguous(), R,
                         gen_logprobs=floats[:-1].view(B, R).to(device) if with_logprobs else None,
                         group_index=ints[:, S + 2].contiguous() if grouped else None)
    return batch, version, float(floats[-1])


def pending(sends: list) -> list:
    """The sends of ``sends`` not completed yet (the completed ones' buffers can go)."""
    return [(w, t) for w, t in sends if not w.is_completed()]


# ---- the batches in flight, checkpointed ------------------------------------------------------------
@dataclass
class GeneratedBatch:
    index: int        # the batch number: the iteration that trains it
    batch: RolloutBatch
    version: int      # the policy version it was sampled under
    seconds: float    # its generation's seconds on the generation pool


class InFlight:
    """The training pool's batches generated but not trained yet, in batch order. Between rounds
    the batches sit in the generation pool's sends; a save takes them in (``put``) and they are
    written with the run's state (TrainState -> trainer_state.json, rank 0, checksummed with the
    rest): tokens, lengths, groups, behaviour log-probs (float32, exactly), policy version. A resume
    trains them first (``take``) at this run's lag (see ``checkpointing.in_flight_problem``)."""

    def __init__(self, lag: int, device: torch.device):
        self.lag, self.device = lag, device
        self.batches: List[GeneratedBatch] = []

    def __len__(self) -> int:
        return len(self.batches)

    def put(self, item: GeneratedBatch) -> None:
        if self.batches and item.index != self.batches[-1].index + 1:
            raise RuntimeError(f"batch {item.index} in flight after batch {self.batches[-1].index}")
        self.batches.append(item)

    def take(self, index: int) -> Optional[GeneratedBatch]:
        """Batch ``index`` when it is the first held, else None (it is still to be received)."""
        if self.batches and self.batches[0].index == index:
            return self.batches.pop(0)
        return None

    def state_dict(self) -> dict:
        return {"lag": self.lag, "batches": [_batch_state(b) for b in self.batches]}

    def load_state_dict(self, state: dict) -> None:
        from puzzle.checkpointing import in_flight_problem

        problem = in_flight_problem(state, self.lag)
        if problem:
            raise ValueError(problem)
        self.batches = [_batch_of_state(b, self.device) for b in state.get("batches", [])]


def _batch_state(g: GeneratedBatch) -> dict:
    b = g.batch
    return {"index": g.index, "version": g.version, "seconds": g.seconds, "max_new_tokens": b.max_new_tokens,
            "tokens": b.tokens.tolist(), "prompt_lengths": b.prompt_lengths.tolist(),
            "response_lengths": b.response_lengths.tolist(),
            "group_index": None if b.group_index is None else b.group_index.tolist(),
            "gen_logprobs": b.gen_logprobs.float().tolist()}  # float32 values: JSON's float keeps them exactly


def _batch_of_state(s: dict, device: torch.device) -> GeneratedBatch:
    def ints(key):
        return torch.tensor(s[key], dtype=torch.long, device=device)

    batch = RolloutBatch(ints("tokens"), ints("prompt_lengths"), ints("response_lengths"), int(s["max_new_tokens"]),
                         gen_logprobs=torch.tensor(s["gen_logprobs"], dtype=torch.float32, device=device),
                         group_index=None if s["group_index"] is None else ints("group_index"))
    return GeneratedBatch(int(s["index"]), batch, int(s["version"]), float(s["seconds"]))


def token_versions(batch: RolloutBatch, version: int) -> torch.Tensor:
    """[B, R] each response token's policy version (-1 after the response)."""
    R = batch.max_new_tokens
    inside = torch.arange(R, device=batch.device)[None, :] < batch.response_lengths[:, None]
    return torch.where(inside, torch.full_like(inside, version, dtype=torch.long),
                       torch.full_like(inside, -1, dtype=torch.long)).cpu()

