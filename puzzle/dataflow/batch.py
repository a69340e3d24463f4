"""The rollout batch carrier and the moves that let models with different layouts share it.

A rollout is small next to the weights (token ids and a few floats per token), so after each
model computes its share it is assembled on EVERY rank with one world all-reduce: each row is
contributed by exactly one owner rank (the last pipeline stage, TP rank 0, of the DP rank that
computed it). Every model then takes its own data-parallel share, whatever its layout.

Sequences are stored right-padded: row b is prompt (P_b tokens), response (R_b tokens), then pad.
With causal attention, padding after the sequence cannot affect it, so scoring and training
need no attention mask and positions start at 0. Per-token quantities live in response
coordinates [B, R] (R = max new tokens): response token k of row b sits at sequence position
P_b + k, is predicted by the logits at P_b + k - 1, and its value estimate is read there too.
Scoring and training micro-batches are packed by default (``pack_rows``, --use-remove-padding):
the rows' P_b + R_b tokens concatenated without padding into one THD sequence, row b starting at
offset start_b, so its response token k is predicted at start_b + P_b + k - 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch
import torch.distributed as dist


@dataclass
class RolloutBatch:
    tokens: torch.Tensor            # [B, S] long, right-padded
    prompt_lengths: torch.Tensor    # [B] long
    response_lengths: torch.Tensor  # [B] long
    max_new_tokens: int
    fields: Dict[str, torch.Tensor] = field(default_factory=dict)  # [B, R] or [B] floats

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    @property
    def response_mask(self) -> torch.Tensor:
        k = torch.arange(self.max_new_tokens, device=self.device).unsqueeze(0)
        return (k < self.response_lengths.unsqueeze(1)).float()

    def rows(self, index: torch.Tensor) -> "RolloutBatch":
        return RolloutBatch(self.tokens[index], self.prompt_lengths[index],
                            self.response_lengths[index], self.max_new_tokens,
                            {k: v[index] for k, v in self.fields.items()})

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

    def share_rows(self, layout, balance: bool = False) -> torch.Tensor:
        """The batch rows of ``layout``'s DP share (``share_for``): contiguous, or with ``balance``
        the same number of rows per DP rank with the token sums balanced (token_budget.balance_rows)."""
        D, d = layout.plan.D, (layout.d if layout.member else 0)
        if not balance:
            n = self.size // D
            return torch.arange(d * n, (d + 1) * n, device=self.device)
        from puzzle.dataflow.token_budget import balance_rows

        return torch.tensor(balance_rows(self.sequence_lengths, D)[d], dtype=torch.long, device=self.device)

    def micro_batch_rows(self, mbs: int, token_budget: Optional[int] = None,
                         count: Optional[int] = None) -> List[List[int]]:
        """Row indices of each micro-batch: ``mbs`` consecutive rows, or with ``token_budget`` as many
        rows as fit that many tokens (token_budget.budget_micro_batches), split further into ``count``
        micro-batches when given (token_budget.split_to_count)."""
        if token_budget is None:
            return [list(range(s, min(s + mbs, self.size))) for s in range(0, self.size, mbs)]
        from puzzle.dataflow.token_budget import budget_micro_batches, split_to_count

        groups = budget_micro_batches(self.sequence_lengths, token_budget)
        return groups if count is None else split_to_count(self.sequence_lengths, groups, count)

    def most_budget_micro_batches(self, D: int, token_budget: int) -> int:
        """The most token-budget micro-batches any of ``D`` data-parallel ranks needs for its
        balanced share (``share_rows(..., balance=True)``): MoE models with experts split over E > 1
        ranks run that many on every DP rank (token_budget.split_to_count)."""
        from puzzle.dataflow.token_budget import balance_rows, budget_micro_batches

        lengths = self.sequence_lengths
        return max(len(budget_micro_batches([lengths[i] for i in share], token_budget))
                   for share in balance_rows(lengths, D))

    def micro_batches(self, mbs: int, packed: bool = False, seq_multiple: int = 1,
                      pad_id: int = 0, token_budget: Optional[int] = None,
                      count: Optional[int] = None) -> List[dict]:
        """Micro-batches as dicts (what forward_step functions read): ``mbs`` rows each, their
        tokens right-padded [mbs, S], or with ``packed`` concatenated without padding (see
        ``pack_rows``; the packed length a multiple of ``seq_multiple``). ``token_budget`` (packed
        only): micro-batches of as many rows as fit the budget (``micro_batch_rows``); each dict's
        ``rows`` are then its rows of this batch, in the order of its outputs; ``count``: exactly that
        many token-budget micro-batches (``micro_batch_rows``)."""
        if token_budget is not None and not packed:
            raise ValueError("token-budget micro-batches need packed sequences")
        out = []
        mask = self.response_mask
        for group in self.micro_batch_rows(mbs, token_budget, count):
            sl = (slice(group[0], group[-1] + 1) if token_budget is None
                  else torch.tensor(group, dtype=torch.long, device=self.device))
            mb = {"tokens": self.tokens[sl], "prompt_lengths": self.prompt_lengths[sl],
                  "response_lengths": self.response_lengths[sl], "response_mask": mask[sl]}
            mb.update({k: v[sl] for k, v in self.fields.items()})
            if packed:
                mb.update(pack_rows(mb["tokens"], mb["prompt_lengths"], mb["response_lengths"],
                                    seq_multiple, pad_id))
            if token_budget is not None:
                mb["rows"] = sl
            out.append(mb)
        return out


def pack_rows(tokens: torch.Tensor, prompt_lengths: torch.Tensor, response_lengths: torch.Tensor,
              seq_multiple: int = 1, pad_id: int = 0) -> dict:
    """Right-padded rows [b, S] -> one packed sequence without padding (megatron's THD):

    ``tokens`` / ``position_ids`` [1, T] (positions restart at 0 in every sequence),
    ``packed_seq_params`` (``PackedSequences``, cu_seqlens over the rows and, when T is rounded up
    to ``seq_multiple`` for sequence parallelism, one filler sequence of ``pad_id`` at the end)
    and ``seq_starts`` [b] (where each row starts in the packed sequence).
    """
    from puzzle.models.packed_attention import PackedSequences

    lengths = (prompt_lengths + response_lengths).tolist()
    b, S = tokens.shape
    keep = torch.arange(S, device=tokens.device).unsqueeze(0) < (prompt_lengths + response_lengths).unsqueeze(1)
    flat = tokens[keep]
    pos = torch.arange(S, device=tokens.device).expand(b, S)[keep]
    total = flat.numel()
    fill = -total % seq_multiple
    if fill:
        flat = torch.cat([flat, flat.new_full((fill,), pad_id)])
        pos = torch.cat([pos, torch.arange(fill, device=pos.device)])
        lengths = lengths + [fill]
    starts = torch.cumsum(prompt_lengths + response_lengths, 0) - (prompt_lengths + response_lengths)
    return {"tokens": flat.unsqueeze(0), "position_ids": pos.unsqueeze(0), "seq_starts": starts,
            "packed_seq_params": PackedSequences.of(lengths, device=tokens.device)}


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


def world_assemble(local: Optional[torch.Tensor], row_offset: int, total_rows: int,
                   shape_tail, dtype, owner: bool, device: torch.device,
                   rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Every rank gets the [total_rows, *shape_tail] tensor (on ``device``) whose rows were
    computed by owners.

    ``local``: this rank's rows (placed at ``row_offset``, or at the indices ``rows``) when
    ``owner``; ignored otherwise.
    """
    buf = torch.zeros((total_rows, *shape_tail), dtype=torch.float64 if dtype.is_floating_point
                      else torch.long, device=device)
    if owner and local is not None and rows is not None:
        buf[rows] = local.to(buf.dtype)
    elif owner and local is not None:
        buf[row_offset:row_offset + local.shape[0]] = local.to(buf.dtype)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(buf)
    return buf.to(dtype)


def gather_outputs(outputs: List[dict], key: str, engine, batch: "RolloutBatch",
                   rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One field of a model's per-micro-batch outputs, assembled on every rank in batch order.

    Rows come from the last pipeline stage, TP rank 0, of each DP rank of ``engine``'s layout:
    its contiguous DP share, or the batch rows ``rows`` (in the order of the outputs) when given.
    """
    lay = engine.layout
    owner = engine.member and lay.is_last_stage and lay.t == 0
    local = torch.cat([o[key] for o in outputs]) if owner else None
    share = batch.size // lay.plan.D
    tail = () if key == "scores" else (batch.max_new_tokens,)
    return world_assemble(local, max(lay.d, 0) * share, batch.size, tail, torch.float32, owner,
                          batch.device, rows=rows)


def rollout_from_generation(prompt_ids: List[List[int]], responses: Optional[torch.Tensor],
                            lengths: Optional[torch.Tensor], layout, max_new_tokens: int,
                            pad_id: int, device: torch.device, seq_multiple: int = 1, *,
                            logprobs: Optional[torch.Tensor] = None, with_logprobs: bool = False) -> RolloutBatch:
    """The world's RolloutBatch from each generation DP rank's [b, R] responses and [b] lengths
    (``GenerationOutput.response_tokens`` / ``response_lengths``: response coordinates).

    ``responses``/``lengths`` are this rank's rows (prompts ``d*b .. (d+1)*b`` of the batch; with
    E > 1 the part of its expert-parallel group, Layout.generation_share) on the ranks that
    generated (any may pass None off the layout); rows are contributed once, by the first pipeline
    stage's TP rank 0 of each part. The sequence length is rounded up to
    ``seq_multiple`` (sequence parallelism splits it over T); padding after a sequence does not
    change it (causal attention). ``with_logprobs`` (the same on every rank): ``logprobs`` [b, R],
    each generated token's log-prob as it was sampled, go into ``fields['gen_logprobs']``.
    """
    B, R = len(prompt_ids), max_new_tokens
    part, parts, first = layout.generation_share() if layout.member else (0, layout.plan.D, False)
    share = B // parts
    owner = first and layout.p == 0 and layout.t == 0
    d0 = part * share
    responses = world_assemble(responses, d0, B, (R,), torch.long, owner, device)
    lengths = world_assemble(lengths, d0, B, (), torch.long, owner, device)
    prompt_lengths = torch.tensor([len(p) for p in prompt_ids], dtype=torch.long)
    seq = -(-int((prompt_lengths + R).max()) // seq_multiple) * seq_multiple
    tokens = right_padded_rows(prompt_ids, responses, lengths, seq, pad_id)
    fields = {}
    if with_logprobs:
        fields["gen_logprobs"] = world_assemble(logprobs, d0, B, (R,), torch.float32, owner, device)
    return RolloutBatch(tokens, prompt_lengths.to(device), lengths, R, fields)


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
                        torch.cat([b.response_lengths for b in batches]), batches[0].max_new_tokens, fields)
