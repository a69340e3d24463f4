"""Micro-batching: how a stage's rows reach its models, owned by one object, ``MicroBatching``.

It owns, for every stage that runs the role models (scoring, training, evaluation's reward model):

- row balancing: each model's data-parallel share of the rows (``share_rows``; with token budgets
  the shares balanced by tokens, token_budget.balance_rows);
- token budgets: ``micro_batch_rows`` groups a share into micro-batches of ``micro_batch_size`` rows
  or of at most a token budget (--use-dynamic-bsz, token_budget.budget_micro_batches);
- packing: ``PackedRows`` drops the padding of every row of an iteration's batch ONCE (its tokens
  and positions, flat), and a packed micro-batch (megatron's THD, ``Packing``) is a gather of its
  rows from there; the packing of a group of rows is kept for the iteration, so every role with
  the same data-parallel layout (the actor and the reference in scoring, the same rows in
  training) runs the very same packed tensors;
- gathering: ``gather_outputs`` assembles a model's per-micro-batch outputs on every rank (each
  row gathered once from its owner, float32 on the device: batch.world_rows).

Micro-batches are ``MicroBatch`` objects (what the forward steps of puzzle/dataflow/steps.py read).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from puzzle.dataflow.batch import ROW_FIELDS, RolloutBatch, world_rows
from puzzle.dataflow.token_budget import balance_rows, budget_micro_batches, split_to_count
from puzzle.pipeline.stage import StageContext, one_program_roles


@dataclass
class Packing:
    """Rows packed without padding into one sequence (megatron's THD): ``tokens`` /
    ``position_ids`` [1, T] (positions restart at 0 in every row), ``packed_seq_params``
    (``PackedSequences``: cu_seqlens over the rows and, when T is rounded up to a multiple for
    sequence parallelism, one filler sequence at the end), ``seq_starts`` [b] (where each row starts)."""

    tokens: torch.Tensor
    position_ids: torch.Tensor
    seq_starts: torch.Tensor
    packed_seq_params: object


@dataclass
class MicroBatch:
    """One micro-batch of a stage: its rows' right-padded ``tokens`` [b, S] (or, packed, the
    ``Packing``'s [1, T]), lengths and response mask, the rollout's per-row fields it carries
    (those the batch has, else None), and for token-budget micro-batches ``rows`` (its batch rows,
    in the order of its outputs). ``dense_shape`` (k, n): the packed rows are k sequences of n
    tokens, run as a [k, n] batch (``schedule_shape``)."""

    tokens: torch.Tensor
    prompt_lengths: torch.Tensor
    response_lengths: torch.Tensor
    response_mask: torch.Tensor
    position_ids: Optional[torch.Tensor] = None
    seq_starts: Optional[torch.Tensor] = None
    packed_seq_params: Optional[object] = None
    dense_shape: Optional[Tuple[int, int]] = None
    rows: Optional[torch.Tensor] = None
    gen_logprobs: Optional[torch.Tensor] = None
    group_index: Optional[torch.Tensor] = None
    loss_mask: Optional[torch.Tensor] = None  # multi-turn: already in response_mask (batch.py)
    policy_loss_mask: Optional[torch.Tensor] = None  # stale carried tokens: read by the actor's loss only
    scores: Optional[torch.Tensor] = None
    baseline_scores: Optional[torch.Tensor] = None
    turn_rewards: Optional[torch.Tensor] = None  # multi-turn: read by the advantages only
    old_logprobs: Optional[torch.Tensor] = None
    entropy: Optional[torch.Tensor] = None
    ref_logprobs: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None
    advantages: Optional[torch.Tensor] = None
    returns: Optional[torch.Tensor] = None

    @classmethod
    def of_tokens(cls, tokens: torch.Tensor) -> "MicroBatch":
        """Right-padded token rows alone (plain language modelling: steps.lm_nll_step)."""
        return cls(tokens, None, None, None)

    @property
    def packed(self) -> bool:
        return self.packed_seq_params is not None

    def tensors(self) -> Dict[str, torch.Tensor]:
        """The tensors it holds, by name (device checks)."""
        return {k: v for k, v in vars(self).items() if isinstance(v, torch.Tensor)}

    # read access by name, as the tests of the stages and the benches look fields up
    def __getitem__(self, name: str):
        value = getattr(self, name, None)
        if value is None:
            raise KeyError(name)
        return value

    def __contains__(self, name: str) -> bool:
        return getattr(self, name, None) is not None


class PackedRows:
    """Every row of one batch without its padding, computed once: the flat tokens and positions
    of rows 0..B-1 one after another, and where each row starts. ``pack(rows)`` gathers a
    micro-batch's packed sequence from there (``rows_packed`` counts the rows packed: each row of
    the batch once)."""

    def __init__(self, batch: RolloutBatch):
        lengths = batch.prompt_lengths + batch.response_lengths
        S = batch.tokens.shape[1]
        keep = torch.arange(S, device=batch.device).unsqueeze(0) < lengths.unsqueeze(1)
        self.source = batch.tokens  # the batch these rows are of (kept alive: compared by identity)
        self.flat = batch.tokens[keep]
        self.positions = torch.arange(S, device=batch.device).expand(batch.size, S)[keep]
        self.lengths: List[int] = lengths.tolist()
        self.offsets = torch.cumsum(lengths, 0) - lengths
        self.rows_packed = batch.size

    def pack(self, rows: torch.Tensor, seq_multiple: int = 1, pad_id: int = 0) -> Packing:
        from puzzle.models.packed_attention import PackedSequences

        lengths = [self.lengths[r] for r in rows.tolist()]
        n = torch.tensor(lengths, dtype=torch.long, device=self.flat.device)
        starts = torch.cumsum(n, 0) - n
        total = int(n.sum())
        # token i of the packed sequence: row offset + (i - that row's start in the packing)
        within = torch.arange(total, device=n.device) - torch.repeat_interleave(starts, n)
        index = torch.repeat_interleave(self.offsets[rows.to(self.offsets.device)], n) + within
        flat, pos = self.flat[index], self.positions[index]
        fill = -total % seq_multiple
        if fill:
            flat = torch.cat([flat, flat.new_full((fill,), pad_id)])
            pos = torch.cat([pos, torch.arange(fill, device=pos.device)])
            lengths = lengths + [fill]
        return Packing(flat.unsqueeze(0), pos.unsqueeze(0), starts,
                       PackedSequences.of(lengths, device=self.flat.device))


def pack_rows(tokens: torch.Tensor, prompt_lengths: torch.Tensor, response_lengths: torch.Tensor,
              seq_multiple: int = 1, pad_id: int = 0) -> Packing:
    """Right-padded rows [b, S] -> their ``Packing`` (one packed sequence without padding)."""
    batch = RolloutBatch(tokens, prompt_lengths, response_lengths, 0)
    return PackedRows(batch).pack(torch.arange(tokens.shape[0], device=tokens.device), seq_multiple, pad_id)


# ---- row balancing and token budgets ------------------------------------------------------------
def share_rows(batch: RolloutBatch, layout, balance: bool = False) -> torch.Tensor:
    """The batch rows of ``layout``'s DP share (off-layout ranks: share 0's): contiguous, or with
    ``balance`` the same number of rows per DP rank with the token sums balanced."""
    D, d = layout.plan.D, (layout.d if layout.member else 0)
    if not balance:
        n = batch.size // D
        return torch.arange(d * n, (d + 1) * n, device=batch.device)
    return torch.tensor(balance_rows(batch.sequence_lengths, D)[d], dtype=torch.long, device=batch.device)


def micro_batch_rows(batch: RolloutBatch, mbs: int, token_budget: Optional[int] = None,
                     count: Optional[int] = None) -> List[List[int]]:
    """Row indices of each micro-batch: ``mbs`` consecutive rows, or with ``token_budget`` as many
    rows as fit that many tokens, split further into ``count`` micro-batches when given."""
    if token_budget is None:
        return [list(range(s, min(s + mbs, batch.size))) for s in range(0, batch.size, mbs)]
    groups = budget_micro_batches(batch.sequence_lengths, token_budget)
    return groups if count is None else split_to_count(batch.sequence_lengths, groups, count)


def most_budget_micro_batches(batch: RolloutBatch, D: int, token_budget: int) -> int:
    """The most token-budget micro-batches any of ``D`` data-parallel ranks needs for its balanced
    share: MoE models with experts split over E > 1 ranks run that many on every DP rank."""
    lengths = batch.sequence_lengths
    return max(len(budget_micro_batches([lengths[i] for i in share], token_budget))
               for share in balance_rows(lengths, D))


def micro_batches(batch: RolloutBatch, mbs: int, packed: bool = False, seq_multiple: int = 1,
                  pad_id: int = 0, token_budget: Optional[int] = None, count: Optional[int] = None,
                  rows: Optional[torch.Tensor] = None, packer: Optional["MicroBatching"] = None) -> List[MicroBatch]:
    """The micro-batches of ``batch``'s rows ``rows`` (all when None): ``mbs`` rows each, right-
    padded [mbs, S], or with ``packed`` concatenated without padding (the packed length a multiple
    of ``seq_multiple``); ``token_budget`` (packed only): as many rows as fit the budget, each
    micro-batch's ``rows`` its batch rows; ``count``: exactly that many token-budget micro-batches.
    ``packer``: the MicroBatching whose packings of this batch's rows are reused."""
    if token_budget is not None and not packed:
        raise ValueError("token-budget micro-batches need packed sequences")
    rows = torch.arange(batch.size, device=batch.device) if rows is None else rows
    part = batch.rows(rows)
    mask = batch.response_mask
    out = []
    for group in micro_batch_rows(part, mbs, token_budget, count):
        idx = rows[torch.tensor(group, dtype=torch.long, device=rows.device)]
        mb = MicroBatch(batch.tokens[idx], batch.prompt_lengths[idx], batch.response_lengths[idx], mask[idx],
                        **{k: v[idx] for k, v in batch.fields.items()})
        if packed:
            packing = (packer or MicroBatching.standalone(seq_multiple, pad_id)).packing(batch, idx)
            mb.tokens, mb.position_ids = packing.tokens, packing.position_ids
            mb.seq_starts, mb.packed_seq_params = packing.seq_starts, packing.packed_seq_params
        if token_budget is not None:
            mb.rows = idx
        out.append(mb)
    return out


def schedule_shape(mbatches: List[MicroBatch], packed: bool, padded_seq: int, mbs: int,
                   seq_multiple: int = 1) -> Tuple[int, int, bool]:
    """(sequence length, rows, whether the shapes vary) of a stage's micro-batches, as the
    schedule and the pipeline stages' exchanges see them: right-padded [mbs, S]; packed [1, T] of
    their own lengths (the stages exchange the shapes when the lengths differ). When every packed
    micro-batch holds k sequences of the same n tokens (n a multiple of ``seq_multiple``) there is
    no padding to remove: each micro-batch's ``dense_shape`` is (k, n) and it runs as a [k, n]
    batch (steps._run)."""
    if not packed:
        return padded_seq, mbs, False
    dense = {_uniform_shape(mb, seq_multiple) for mb in mbatches}
    if len(dense) == 1 and None not in dense:
        (k, n), = dense
        for mb in mbatches:
            mb.dense_shape = (k, n)
        return n, k, False
    lengths = {mb.tokens.shape[1] for mb in mbatches}
    return max(lengths), 1, len(lengths) > 1


def _uniform_shape(mb: MicroBatch, seq_multiple: int) -> Optional[Tuple[int, int]]:
    lengths = mb.packed_seq_params.lengths
    n = lengths[0]
    if n % seq_multiple or any(x != n for x in lengths):
        return None
    return len(lengths), n


# ---- gathering ----------------------------------------------------------------------------------
def gather_outputs(outputs: List[dict], key: str, engine, batch: RolloutBatch,
                   rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One field of a model's per-micro-batch outputs, assembled on every rank in batch order, as
    float32 on the batch's device (``world_rows``: gathered, each row once).

    Rows come from the last pipeline stage, TP rank 0, of each DP rank of ``engine``'s layout
    (``ParallelPlan.output_owners``): its contiguous DP share, or the batch rows ``rows`` (in the
    order of the outputs) when given.
    """
    lay = engine.layout
    owner = engine.member and lay.is_last_stage and lay.t == 0
    local = torch.cat([o[key] for o in outputs]) if owner else None
    tail = () if key == "scores" else (batch.max_new_tokens,)
    return world_rows(local, lay.plan.output_owners(), batch.size, tail, torch.float32, batch.device, rows=rows)


#: roles without an engine of their own when the run has none for them: a LoRA actor's reference
BORROWED_ENGINES = {"ref": "actor"}


class MicroBatching:
    """Each model's micro-batches of a batch: ``micro_batch_size`` rows of its DP share, packed
    without padding (``packed``, --use-remove-padding) or right-padded; with ``dynamic_bsz``
    (--use-dynamic-bsz) and a token budget, DP shares balanced by tokens and micro-batches of at
    most that many tokens. The packings of the latest batch's rows are kept (``packing``): each
    row is unpadded once, and a group of rows packed once, for every role, mini-batch and epoch."""

    def __init__(self, engines: Dict, micro_batch_size: int, packed: bool, seq_multiple: int, pad_id: int,
                 dynamic_bsz: bool = False):
        self.engines, self.micro_batch_size, self.packed = engines, micro_batch_size, packed
        self.seq_multiple, self.pad_id, self.dynamic_bsz = seq_multiple, pad_id, dynamic_bsz
        self._rows: Optional[PackedRows] = None
        self._packings: Dict[Tuple[int, ...], Packing] = {}
        self.rows_unpadded = self.groups_packed = 0  # counters (puzzle.bench.dataflow)

    @classmethod
    def standalone(cls, seq_multiple: int = 1, pad_id: int = 0) -> "MicroBatching":
        return cls({}, 1, True, seq_multiple, pad_id)

    def packing(self, batch: RolloutBatch, rows: torch.Tensor) -> Packing:
        """The packed sequence of ``batch``'s ``rows`` (in that order), the same object for the
        same rows of the same batch tokens."""
        if self._rows is None or self._rows.source is not batch.tokens:
            self._rows, self._packings = PackedRows(batch), {}
            self.rows_unpadded += batch.size
        key = tuple(rows.tolist())
        if key not in self._packings:
            self._packings[key] = self._rows.pack(rows, self.seq_multiple, self.pad_id)
            self.groups_packed += 1
        return self._packings[key]

    def contexts(self, batch: RolloutBatch, jobs: List[Tuple[str, object]],
                 token_budget: Optional[int] = None, placement: str = "sequential",
                 rows: Optional[torch.Tensor] = None) -> List[StageContext]:
        """A StageContext per (role, forward_step) job over its model's DP share of ``batch``'s
        ``rows`` (all when None; a training mini-batch otherwise) (``token_budget``:
        --ppo-max-token-len-per-gpu or --log-prob-max-token-len-per-gpu; ``placement``: the stage's,
        see ``_equal_counts``). The contexts' ``rows`` (token budgets) index ``batch`` restricted
        to ``rows``."""
        mbs, packed = self.micro_batch_size, self.packed
        token_budget = token_budget if self.dynamic_bsz else None
        equal = self._equal_counts(jobs, placement) if token_budget is not None else set()
        rows = torch.arange(batch.size, device=batch.device) if rows is None else rows
        part = batch.rows(rows)
        contexts = []
        for role, fn in jobs:
            eng = self.engine(role)
            order = share_rows(part, eng.layout, balance=token_budget is not None)
            count = None  # every DP rank runs as many micro-batches (token_budget.split_to_count)
            if role in equal and eng.layout.plan.D > 1:
                count = most_budget_micro_batches(part, eng.layout.plan.D, token_budget)
            mbatches = micro_batches(batch, mbs, packed=packed, seq_multiple=self.seq_multiple,
                                     pad_id=self.pad_id, token_budget=token_budget, count=count,
                                     rows=rows[order], packer=self)
            out_rows = None
            if token_budget is not None:  # outputs in micro-batch order: their rows of ``part``
                where = torch.empty(batch.size, dtype=torch.long, device=batch.device)
                where[rows] = torch.arange(len(rows), device=batch.device)
                out_rows = where[torch.cat([mb.rows for mb in mbatches])]
            seq, nrows, variable = schedule_shape(mbatches, packed, batch.tokens.shape[1], mbs, self.seq_multiple)
            if eng.member:
                eng.config.variable_seq_lengths = variable and eng.layout.plan.P > 1
            contexts.append(StageContext(eng, fn, iter(mbatches), len(mbatches), seq, nrows, rows=out_rows))
        return contexts

    def gather(self, outputs: List[dict], key: str, role: str, batch: RolloutBatch,
               rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``gather_outputs`` of ``role``'s outputs."""
        return gather_outputs(outputs, key, self.engine(role), batch, rows)

    def engine(self, role: str):
        """The engine that runs ``role``'s jobs: its own, or for the reference of a LoRA actor
        (no reference engine: scoring_stage runs the actor with its adapters off) the actor's."""
        return self.engines[role] if role in self.engines else self.engines[BORROWED_ENGINES[role]]

    def _equal_counts(self, jobs: List[Tuple[str, object]], placement: str) -> set:
        """The roles whose token-budget micro-batches must number the same on every DP rank: MoE
        models with experts split over E > 1 ranks (their dispatchers' collectives run once per
        micro-batch in every rank of an expert group), and the models of a time-shared stream whose
        pipelines must all run one program (puzzle.parallel.streams.needs_one_program: equal P at
        different (D, T) on the same ranks). Fixed-count micro-batches number the same on every
        DP rank anyway (``share_rows`` gives each the same number of rows)."""
        plans = {role: self.engine(role).layout.plan for role, _ in jobs}
        equal = set(one_program_roles(plans, placement))
        return equal | {role for role, _ in jobs if self.engine(role).arch.is_moe and plans[role].E > 1}


__all__ = ["MicroBatch", "MicroBatching", "Packing", "PackedRows", "ROW_FIELDS", "gather_outputs",
           "micro_batch_rows", "micro_batches", "most_budget_micro_batches", "pack_rows", "schedule_shape",
           "share_rows"]
