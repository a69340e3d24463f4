"""The rollout batch carrier and the moves that let models with different layouts share it.

A rollout is small next to the weights (token ids and a few floats per token), so after each
model computes its share it is assembled on EVERY rank (``world_rows``): each row is handed on by
exactly one owner rank (the last pipeline stage, TP rank 0, of the DP rank that computed it) and
gathered on the device in its own dtype (int64 tokens and lengths, float32 log-probs and values).
Every model then takes its own data-parallel share, whatever its layout.

Sequences are stored right-padded: row b is prompt (P_b tokens), response (R_b tokens), then pad.
With causal attention, padding after the sequence cannot affect it, so scoring and training
need no attention mask and positions start at 0. Per-token quantities live in response
coordinates [B, R] (R = max new tokens): response token k of row b sits at sequence position
P_b + k, is predicted by the logits at P_b + k - 1, and its value estimate is read there too.
Scoring and training micro-batches are packed by default (micro_batching.py, --use-remove-padding):
the rows' P_b + R_b tokens concatenated without padding into one THD sequence, row b starting at
offset start_b, so its response token k is predicted at start_b + P_b + k - 1.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import List, Mapping, Optional

import torch
import torch.distributed as dist

from puzzle.parallel.scope import scope_group, scope_ranks


#: the per-row fields of a rollout ([B, R] or [B]) and the one stage that writes each
ROW_FIELDS = {"gen_logprobs": "generation", "group_index": "generation", "loss_mask": "generation",
              "policy_loss_mask": "generation",
              "scores": "reward", "baseline_scores": "reward", "turn_rewards": "reward",
              "old_logprobs": "scoring", "entropy": "scoring", "ref_logprobs": "scoring", "values": "scoring",
              "advantages": "advantages", "returns": "advantages"}


@dataclass(frozen=True)
class RolloutBatch:
    """The rows of an iteration and the fields the stages add to them. Frozen: a stage returns its
    outputs and ``with_outputs`` gives the batch that holds them; each field (``ROW_FIELDS``) is
    written by exactly one stage, once."""

    tokens: torch.Tensor            # [B, S] long, right-padded
    prompt_lengths: torch.Tensor    # [B] long
    response_lengths: torch.Tensor  # [B] long
    max_new_tokens: int
    gen_logprobs: Optional[torch.Tensor] = None     # [B, R] generation: each token's log-prob as sampled
    group_index: Optional[torch.Tensor] = None      # [B] generation: the prompt of each row (N > 1)
    # [B, R] generation (multi-turn, --env): 1 for the model's tokens, 0 for the observation tokens
    # an environment inserted (in the sequence, attended to, but no loss, KL, value target or advantage)
    loss_mask: Optional[torch.Tensor] = None
    # [B, R] generation (--rl-partial-rollouts-max-staleness): 0 for the carried tokens sampled too many
    # policy versions ago: scored, in the advantages and the critic's targets, but not in the actor's loss
    policy_loss_mask: Optional[torch.Tensor] = None
    scores: Optional[torch.Tensor] = None           # [B] reward: raw sequence scores
    baseline_scores: Optional[torch.Tensor] = None  # [B] reward: ReMax's greedy baseline, shaped
    # [B, R] reward (multi-turn): each environment step's reward at the last token of its turn
    turn_rewards: Optional[torch.Tensor] = None
    old_logprobs: Optional[torch.Tensor] = None     # [B, R] scoring: the actor's
    entropy: Optional[torch.Tensor] = None          # [B, R] scoring: the actor's
    ref_logprobs: Optional[torch.Tensor] = None     # [B, R] scoring: the reference's
    values: Optional[torch.Tensor] = None           # [B, R] scoring: the critic's
    advantages: Optional[torch.Tensor] = None       # [B, R] advantages
    returns: Optional[torch.Tensor] = None          # [B, R] advantages

    @property
    def fields(self) -> Mapping[str, torch.Tensor]:
        """The per-row fields written so far, by name (read only)."""
        return MappingProxyType({k: getattr(self, k) for k in ROW_FIELDS if getattr(self, k) is not None})

    def with_outputs(self, stage: str, **outputs: torch.Tensor) -> "RolloutBatch":
        """This batch with ``stage``'s outputs; raises ValueError for a field of another stage or
        one written already."""
        for name in outputs:
            if ROW_FIELDS.get(name) != stage:
                raise ValueError(f"the {stage} stage cannot write the batch field {name!r} "
                                 f"(written by: {ROW_FIELDS.get(name, 'no stage')})")
            if getattr(self, name) is not None:
                raise ValueError(f"the batch field {name!r} is written once, by the {stage} stage")
        return replace(self, **outputs)

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    @property
    def response_mask(self) -> torch.Tensor:
        """[B, R] float: 1 for the response tokens that are trained on (the model's: the loss,
        KL, value targets and advantages read only these), 0 for padding and observations."""
        k = torch.arange(self.max_new_tokens, device=self.device).unsqueeze(0)
        mask = (k < self.response_lengths.unsqueeze(1)).float()
        return mask if self.loss_mask is None else mask * self.loss_mask.to(mask.dtype)

    def rows(self, index: torch.Tensor) -> "RolloutBatch":
        return RolloutBatch(self.tokens[index], self.prompt_lengths[index],
                            self.response_lengths[index], self.max_new_tokens,
                            **{k: v[index] for k, v in self.fields.items()})

    def dp_share(self, d: int, D: int) -> "RolloutBatch":
        n = self.size // D
        return self.rows(torch.arange(d * n, (d + 1) * n, device=self.device))

    def share_for(self, layout) -> "RolloutBatch":
        """The rows a model in ``layout`` works on: its DP rank's share (off-layout ranks get
        share 0's shape so that stage bookkeeping is the same on every rank)."""
        D = layout.plan.D
        return self.dp_share(layout.d if layout.member else 0, D)

    @property
    def sequence_lengths(self) -> List[int]:
        """[B] host ints: each row's prompt + response tokens."""
        return (self.prompt_lengths + self.response_lengths).tolist()


def packed_response_index(seq_starts: torch.Tensor, prompt_lengths: torch.Tensor, R: int, total: int,
                          shift: int = -1) -> torch.Tensor:
    """[b, R] packed positions start_b + P_b + k + shift (clamped into the packed sequence)."""
    k = torch.arange(R, device=prompt_lengths.device).unsqueeze(0)
    return ((seq_starts + prompt_lengths).unsqueeze(1) + k + shift).clamp(0, total - 1)


def response_index(prompt_lengths: torch.Tensor, R: int, seq_len: int, shift: int = -1) -> torch.Tensor:
    """[b, R] positions P_b + k + shift (clamped into the sequence)."""
    k = torch.arange(R, device=prompt_lengths.device).unsqueeze(0)
    return (prompt_lengths.unsqueeze(1) + k + shift).clamp(0, seq_len - 1)


def gather_response(per_position: torch.Tensor, prompt_lengths: torch.Tensor, R: int,
                    shift: int = -1) -> torch.Tensor:
    """[b, S'] per-position values -> [b, R] values at positions P_b + k + shift."""
    idx = response_index(prompt_lengths, R, per_position.shape[1], shift)
    return per_position.gather(1, idx)


#: the assembly before the batch moved in its own dtype (every field through a float64 zero buffer
#: and a world all-reduce); kept only so that puzzle.bench.dataflow times both in one run
_LEGACY_ASSEMBLY = False


def world_rows(local: Optional[torch.Tensor], owners: List[int], total_rows: int, shape_tail, dtype,
               device: torch.device, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Every rank gets the [total_rows, *shape_tail] ``dtype`` tensor (on ``device``) whose rows
    were computed by ``owners`` (global ranks, one per part, in the parts' order): owner k's rows
    are k*n .. (k+1)*n - 1 (n = total_rows // len(owners)) or, with ``rows``, its batch rows
    ``rows`` (in the order of ``local``; only the owner's count, but every rank passes some or
    every rank None). ``local``: this rank's n rows when it is an owner (ignored otherwise).

    Each owner's rows move once, in ``dtype``, on the device: one all-gather when every rank of
    the world owns a part in rank order, else one broadcast from each owner (``rows`` move along).
    """
    if _LEGACY_ASSEMBLY:
        return _legacy_assemble(local, owners, total_rows, shape_tail, dtype, device, rows)
    n = total_rows // len(owners)
    me = dist.get_rank() if dist.is_initialized() else 0
    mine = None
    if me in owners:
        if local is None or local.shape[0] != n:
            raise ValueError(f"rank {me} owns {n} rows of the batch but has "
                             f"{'none' if local is None else local.shape[0]}")
        mine = local.to(device=device, dtype=dtype).contiguous()
        if rows is not None:
            rows = rows.to(device=device, dtype=torch.long)
    values = _from_owners(mine, owners, (n, *shape_tail), dtype, device)
    if rows is None:
        return values
    where = _from_owners(rows, owners, (n,), torch.long, device)
    out = torch.empty((total_rows, *shape_tail), dtype=dtype, device=device)
    out[where] = values
    return out


def _from_owners(mine: Optional[torch.Tensor], owners: List[int], part_shape, dtype,
                 device: torch.device) -> torch.Tensor:
    """The owners' parts (each ``part_shape``) one after another, on every rank."""
    world, group = scope_ranks(), scope_group()  # the world, or one pool of --rl-desired-lag
    if len(world) == 1:
        return mine
    if owners == world:
        out = torch.empty((len(world) * part_shape[0], *part_shape[1:]), dtype=dtype, device=device)
        dist.all_gather_into_tensor(out, mine, group=group)
        return out
    out = torch.empty((len(owners) * part_shape[0], *part_shape[1:]), dtype=dtype, device=device)
    me = dist.get_rank()
    for k, src in enumerate(owners):
        part = out[k * part_shape[0]:(k + 1) * part_shape[0]]  # contiguous: a slice of the first dim
        if src == me:
            part.copy_(mine)
        dist.broadcast(part, src, group=group)
    return out


def _legacy_assemble(local: Optional[torch.Tensor], owners: List[int], total_rows: int, shape_tail,
                     dtype, device: torch.device, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``world_rows`` as it was: a float64 (long) zero buffer holding the owners' rows, summed over
    the world by one all-reduce, then cast to ``dtype``."""
    me = dist.get_rank() if dist.is_initialized() else 0
    buf = torch.zeros((total_rows, *shape_tail), dtype=torch.float64 if dtype.is_floating_point
                      else torch.long, device=device)
    if me in owners and rows is not None:
        buf[rows] = local.to(buf.dtype)
    elif me in owners:
        n = total_rows // len(owners)
        k = owners.index(me)
        buf[k * n:(k + 1) * n] = local.to(buf.dtype)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(buf)
    return buf.to(dtype)


def rollout_from_generation(prompt_ids: List[List[int]], responses: Optional[torch.Tensor],
                            lengths: Optional[torch.Tensor], layout, max_new_tokens: int,
                            pad_id: int, device: torch.device, seq_multiple: int = 1, *,
                            logprobs: Optional[torch.Tensor] = None, with_logprobs: bool = False,
                            loss_mask: Optional[torch.Tensor] = None, with_loss_mask: bool = False) -> RolloutBatch:
    """The world's RolloutBatch from each generation DP rank's [b, R] responses and [b] lengths
    (``GenerationOutput.response_tokens`` / ``response_lengths``: response coordinates).

    ``responses``/``lengths`` are this rank's rows (prompts ``d*b .. (d+1)*b`` of the batch; with
    E > 1 the part of its expert-parallel group, Layout.generation_share) on the ranks that
    generated (any may pass None off the layout); rows are handed on once, by the first pipeline
    stage's TP rank 0 of each part (``ParallelPlan.generation_owners``): tokens and lengths in one
    int64 gather, log-probs in one float32 gather (``world_rows``). The sequence length is rounded
    up to ``seq_multiple`` (sequence parallelism splits it over T); padding after a sequence does
    not change it (causal attention). ``with_logprobs`` (the same on every rank): ``logprobs``
    [b, R], each generated token's log-prob as it was sampled, are the batch's ``gen_logprobs``;
    ``with_loss_mask`` (multi-turn): ``loss_mask`` [b, R] (0 at observation tokens) its ``loss_mask``.
    """
    B, R = len(prompt_ids), max_new_tokens
    owners = layout.plan.generation_owners()
    if _LEGACY_ASSEMBLY:
        responses = world_rows(responses, owners, B, (R,), torch.long, device)
        lengths = world_rows(lengths, owners, B, (), torch.long, device)
    else:  # one gather of [b, R + 1]: the responses, then the lengths
        local = torch.cat([responses, lengths.unsqueeze(1)], 1) if responses is not None else None
        both = world_rows(local, owners, B, (R + 1,), torch.long, device)
        responses, lengths = both[:, :R], both[:, R].contiguous()
    prompt_lengths = torch.tensor([len(p) for p in prompt_ids], dtype=torch.long)
    seq = -(-int((prompt_lengths + R).max()) // seq_multiple) * seq_multiple
    tokens = right_padded_rows(prompt_ids, responses, lengths, seq, pad_id)
    gen_logprobs = world_rows(logprobs, owners, B, (R,), torch.float32, device) if with_logprobs else None
    mask = world_rows(loss_mask, owners, B, (R,), torch.float32, device) if with_loss_mask else None
    return RolloutBatch(tokens, prompt_lengths.to(device), lengths, R, gen_logprobs=gen_logprobs, loss_mask=mask)


def right_padded_rows(prompt_ids: List[List[int]], response_tokens: torch.Tensor,
                      response_lengths: torch.Tensor, seq_len: int, pad_id: int) -> torch.Tensor:
    """Rows [B, seq_len] on the responses' device: row b is prompt b, its first
    ``response_lengths[b]`` response tokens ([B, R] response coordinates), then ``pad_id``
    (``seq_len`` >= every prompt's length + R)."""
    B, R = response_tokens.shape
    dev = response_tokens.device
    out = torch.full((B, seq_len), pad_id, dtype=torch.long)
    for b, p in enumerate(prompt_ids):
        out[b, :len(p)] = torch.tensor(p, dtype=torch.long)
    out = out.to(dev)
    if R:
        p = torch.tensor([len(x) for x in prompt_ids], dtype=torch.long, device=dev).unsqueeze(1)
        col = p + torch.arange(R, device=dev).unsqueeze(0)                  # [B, R] where each goes
        keep = torch.arange(R, device=dev).unsqueeze(0) < response_lengths.unsqueeze(1)
        out.scatter_(1, col, torch.where(keep, response_tokens, torch.full_like(response_tokens, pad_id)))
    return out


def concat_rollouts(batches: List[RolloutBatch], pad_id: int) -> RolloutBatch:
    """Rows of several rollouts (same max_new_tokens and fields) in order, right-padded to the
    widest sequence."""
    width = max(b.tokens.shape[1] for b in batches)
    tokens = torch.cat([torch.nn.functional.pad(b.tokens, (0, width - b.tokens.shape[1]), value=pad_id)
                        for b in batches])
    fields = {k: torch.cat([b.fields[k] for b in batches]) for k in batches[0].fields}
    return RolloutBatch(tokens, torch.cat([b.prompt_lengths for b in batches]),
                        torch.cat([b.response_lengths for b in batches]), batches[0].max_new_tokens, **fields)
