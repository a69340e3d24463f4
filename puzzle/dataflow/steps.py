"""forward_step / loss_func per role, in megatron's callback convention.

``forward_step(data_iterator, model) -> (output, partial(loss_func, ...))``; every loss_func
returns megatron's per-token triple ``(loss_sum, num_tokens, report)``. Reports carry SUMS (and
token counts) so they aggregate exactly across micro-batches and ranks.
"""

from __future__ import annotations

import contextlib
from functools import partial

import torch

from puzzle.algorithms import agg_loss, entropy_bonus, kl_penalty, policy_loss, value_loss
from puzzle.algorithms.rollout_correction import truncated_is_weights
from puzzle.models.batch_invariant import batch_invariant_mode
from puzzle.models.lora import adapters_disabled
from puzzle.parallel.device import check_on_device
from puzzle.dataflow.batch import gather_response, packed_response_index
from puzzle.dataflow.micro_batching import MicroBatch
from puzzle.engine.vocab_parallel import vocab_parallel_logprobs


def _unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def _run(model, mb):
    tokens = mb.tokens
    check_on_device("forward_step", _unwrap(model).puzzle_device, mb.tensors())
    dense = mb.dense_shape
    if dense is not None:  # k packed sequences of n tokens each: run as a [k, n] batch (no padding)
        k, n = dense
        out = model(tokens.view(k, n), mb.position_ids.view(k, n), None)
        return out.reshape(1, k * n, *out.shape[2:]) if _unwrap(model).post_process else out
    packed = mb.packed_seq_params
    if packed is not None:  # one packed sequence [1, T], positions restarting per sequence
        return model(tokens, mb.position_ids, None, packed_seq_params=packed)
    pos = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
    return model(tokens, pos, None)


def at_response(per_position: torch.Tensor, mb, R: int, shift: int = -1) -> torch.Tensor:
    """Per-position values of a micro-batch ([b, S'] padded, [1, T'] packed) -> [b, R] values at
    each row's positions P_b + k + shift (response coordinates)."""
    if mb.seq_starts is None:
        return gather_response(per_position, mb.prompt_lengths, R, shift)
    idx = packed_response_index(mb.seq_starts, mb.prompt_lengths, R, per_position.shape[1], shift)
    return per_position[0][idx]


def _last_token(per_position: torch.Tensor, mb) -> torch.Tensor:
    """[b] values at each row's last token."""
    last = (mb.prompt_lengths + mb.response_lengths - 1).clamp(min=0)
    if mb.seq_starts is not None:
        return per_position[0][mb.seq_starts + last]
    return per_position.gather(1, last.unsqueeze(1)).squeeze(1)


def _response_logprobs(output, mb, tp_group, true_vocab, temperature, R, with_entropy=False):
    res = vocab_parallel_logprobs(output[:, :-1], mb.tokens[:, 1:], tp_group, true_vocab,
                                  temperature=temperature, with_entropy=with_entropy)
    if with_entropy:
        lp, ent = res
        return at_response(lp, mb, R), at_response(ent, mb, R)
    return at_response(res, mb, R)


def _zero_loss(output):
    return output.sum() * 0.0


# ---- scoring (forward-only) ------------------------------------------------------------------
def logprob_score_step(true_vocab: int, temperature: float, R: int, with_entropy: bool = False,
                       batch_invariant: bool = False, adapters_off: bool = False):
    """Actor old log-probs / reference log-probs: report {'logprobs': [mb, R]} (+ 'entropy').
    ``batch_invariant`` (--batch-invariant-mode): the forward and the log-probs in the mode of
    puzzle/models/batch_invariant.py, the arithmetic generation ran. ``adapters_off``: the forward
    of a LoRA actor's base (its reference: puzzle.models.lora.adapters_disabled)."""

    def loss_func(mb, tp_group, output):
        with batch_invariant_mode(batch_invariant):
            res = _response_logprobs(output, mb, tp_group, true_vocab, temperature, R, with_entropy)
        lp, ent = res if with_entropy else (res, None)
        report = {"logprobs": lp.detach()}
        if ent is not None:
            report["entropy"] = ent.detach()
        return _zero_loss(output), torch.tensor(1, dtype=torch.int), report

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        base = adapters_disabled(_unwrap(model)) if adapters_off else contextlib.nullcontext()
        with batch_invariant_mode(batch_invariant), base:
            output = _run(model, mb)
        return output, partial(loss_func, mb, _unwrap(model).pg_collection.tp)

    return forward_step


def value_score_step(R: int):
    """Critic values at the positions that predict each response token: {'values': [mb, R]}."""

    def loss_func(mb, output):
        v = at_response(output[..., 0].float(), mb, R)
        return _zero_loss(output), torch.tensor(1, dtype=torch.int), {"values": v.detach()}

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        return _run(model, mb), partial(loss_func, mb)

    return forward_step


def reward_score_step():
    """Reward model score at the last token of each sequence: {'scores': [mb]}."""

    def loss_func(mb, output):
        s = _last_token(output[..., 0].float(), mb)
        return _zero_loss(output), torch.tensor(1, dtype=torch.int), {"scores": s.detach()}

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        return _run(model, mb), partial(loss_func, mb)

    return forward_step


# ---- training -------------------------------------------------------------------------------
def actor_train_step(true_vocab: int, temperature: float, R: int, clip_eps: float,
                     entropy_coef: float, *, clip_eps_high=None, loss_agg: str = "token-mean",
                     kl_loss_coef: float = 0.0, kl_loss_type: str = "low_var_kl", use_kl_loss: bool = False,
                     is_correction: bool = False, is_truncation_coef=None):
    """PPO clipped surrogate minus the entropy bonus (plus ``kl_loss_coef`` x KL to the reference
    with ``use_kl_loss``), aggregated over the mini-batch by ``loss_agg`` (the per-token
    convention's "tokens" are then the aggregation weights: tokens or non-empty sequences).
    Reports carry token sums for the metrics and ``loss_weight`` for the loss itself.
    ``is_correction``: each token's clipped loss weighted by its truncated importance weight
    ``min(exp(old - generation log-prob), is_truncation_coef)`` (puzzle/algorithms/rollout_correction.py)."""

    def loss_func(mb, tp_group, output):
        mask = mb.response_mask if mb.policy_loss_mask is None else mb.response_mask * mb.policy_loss_mask
        res = _response_logprobs(output, mb, tp_group, true_vocab, temperature, R,
                                 with_entropy=entropy_coef > 0)
        lp, ent = res if entropy_coef > 0 else (res, None)
        n = mask.sum()
        w_is = truncated_is_weights(mb.old_logprobs, mb.gen_logprobs, mask, is_truncation_coef)[0] \
            if is_correction else None
        if loss_agg == "token-mean" and not use_kl_loss:  # PPO: exactly the numbers of earlier runs
            pg, clip_frac, approx_kl, weight = policy_loss(lp, mb.old_logprobs, mb.advantages,
                                                          mask, clip_eps=clip_eps, clip_eps_high=clip_eps_high,
                                                          token_weights=w_is)
            loss_sum, w = pg * n, n
            ent_sum = (ent * mask).sum() if ent is not None else None
            ent_term = ent_sum
        else:  # numerators (denominator 1) of the chosen aggregation; weights summed by megatron
            pg, clip_frac, approx_kl, w = policy_loss(lp, mb.old_logprobs, mb.advantages, mask,
                                                     clip_eps=clip_eps, clip_eps_high=clip_eps_high,
                                                     loss_agg=loss_agg, denominator=1.0, token_weights=w_is)
            loss_sum = pg
            ent_sum = (ent * mask).sum() if ent is not None else None
            ent_term = entropy_bonus(ent, mask, loss_agg, denominator=1.0) if ent is not None else None
        report = {"policy_loss_sum": loss_sum.detach(), "clip_sum": clip_frac * n,
                  "approx_kl_sum": approx_kl * n, "tokens": n, "loss_weight": w.detach()}
        if use_kl_loss:
            kl = kl_penalty(lp, mb.ref_logprobs, kl_loss_type)
            kl_term = agg_loss(kl, mask, loss_agg, denominator=1.0)[0]
            loss_sum = loss_sum + kl_loss_coef * kl_term
            report["kl_loss_sum"] = (torch.where(mask != 0, kl, torch.zeros_like(kl))).sum().detach()
        if ent is not None:
            loss_sum = loss_sum - entropy_coef * ent_term
            report["entropy_sum"] = ent_sum.detach()
        return loss_sum, w.to(torch.int), report

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        return _run(model, mb), partial(loss_func, mb, _unwrap(model).pg_collection.tp)

    return forward_step


def critic_train_step(R: int, value_clip_eps):
    """Clipped value loss (token-mean over the mini-batch)."""

    def loss_func(mb, output):
        mask = mb.response_mask
        v = at_response(output[..., 0].float(), mb, R)
        vl, vclip, weight = value_loss(v, mb.values, mb.returns, mask,
                                       value_clip_eps=value_clip_eps)
        n = mask.sum()
        loss_sum = vl * n
        return loss_sum, n.to(torch.int), {"value_loss_sum": loss_sum.detach(),
                                           "value_clip_sum": vclip * n, "tokens": n}

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        return _run(model, mb), partial(loss_func, mb)

    return forward_step


# ---- plain language modelling ------------------------------------------------------------------
def lm_nll_step(true_vocab: int, store=None):
    """Next-token negative log-likelihood of [mb, S] token micro-batches (sum over tokens, in the
    per-token convention). ``store``, when given, collects each micro-batch's log-probs
    [mb, S-1] (last pipeline stage only). Used for checks and benchmarks of models and layouts."""

    def loss_func(tokens, tp_group, output):
        lp = vocab_parallel_logprobs(output[:, :-1], tokens[:, 1:], tp_group, true_vocab)
        if store is not None:
            store.append(lp.detach().clone())
        return -lp.sum(), torch.tensor(lp.numel(), dtype=torch.int), {"nll_sum": -lp.detach().sum()}

    def forward_step(data_iterator, model):
        tokens = next(data_iterator)
        return _run(model, MicroBatch.of_tokens(tokens)), partial(loss_func, tokens, _unwrap(model).pg_collection.tp)

    return forward_step
