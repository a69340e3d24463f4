"""forward_step / loss_func per role, in megatron's callback convention.

``forward_step(data_iterator, model) -> (output, partial(loss_func, ...))``; every loss_func
returns megatron's per-token triple ``(loss_sum, num_tokens, report)``. Reports carry SUMS (and
token counts) so they aggregate exactly across micro-batches and ranks.
"""

from __future__ import annotations

from functools import partial

import torch

from puzzle.algorithms import policy_loss, value_loss
from puzzle.parallel.device import check_on_device
from puzzle.training.batch import gather_response
from puzzle.training.vocab_parallel import vocab_parallel_logprobs


def _unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def _run(model, mb):
    tokens = mb["tokens"]
    check_on_device("forward_step", _unwrap(model).puzzle_device, mb)
    pos = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)
    return model(tokens, pos, None)


def _response_logprobs(output, mb, tp_group, true_vocab, temperature, R, with_entropy=False):
    res = vocab_parallel_logprobs(output[:, :-1], mb["tokens"][:, 1:], tp_group, true_vocab,
                                  temperature=temperature, with_entropy=with_entropy)
    if with_entropy:
        lp, ent = res
        return gather_response(lp, mb["prompt_lengths"], R), gather_response(ent, mb["prompt_lengths"], R)
    return gather_response(res, mb["prompt_lengths"], R)


def _zero_loss(output):
    return output.sum() * 0.0


# ---- scoring (forward-only) ------------------------------------------------------------------
def logprob_score_step(true_vocab: int, temperature: float, R: int, with_entropy: bool = False):
    """Actor old log-probs / reference log-probs: report {'logprobs': [mb, R]} (+ 'entropy')."""

    def loss_func(mb, tp_group, output):
        res = _response_logprobs(output, mb, tp_group, true_vocab, temperature, R, with_entropy)
        lp, ent = res if with_entropy else (res, None)
        report = {"logprobs": lp.detach()}
        if ent is not None:
            report["entropy"] = ent.detach()
        return _zero_loss(output), torch.tensor(1, dtype=torch.int), report

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        return _run(model, mb), partial(loss_func, mb, _unwrap(model).pg_collection.tp)

    return forward_step


def value_score_step(R: int):
    """Critic values at the positions that predict each response token: {'values': [mb, R]}."""

    def loss_func(mb, output):
        v = gather_response(output[..., 0].float(), mb["prompt_lengths"], R)
        return _zero_loss(output), torch.tensor(1, dtype=torch.int), {"values": v.detach()}

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        return _run(model, mb), partial(loss_func, mb)

    return forward_step


def reward_score_step():
    """Reward model score at the last token of each sequence: {'scores': [mb]}."""

    def loss_func(mb, output):
        last = (mb["prompt_lengths"] + mb["response_lengths"] - 1).clamp(min=0)
        s = output[..., 0].float().gather(1, last.unsqueeze(1)).squeeze(1)
        return _zero_loss(output), torch.tensor(1, dtype=torch.int), {"scores": s.detach()}

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        return _run(model, mb), partial(loss_func, mb)

    return forward_step


# ---- training -------------------------------------------------------------------------------
def actor_train_step(true_vocab: int, temperature: float, R: int, clip_eps: float,
                     entropy_coef: float):
    """PPO clipped surrogate (token-mean over the mini-batch) minus the entropy bonus."""

    def loss_func(mb, tp_group, output):
        mask = mb["response_mask"]
        res = _response_logprobs(output, mb, tp_group, true_vocab, temperature, R,
                                 with_entropy=entropy_coef > 0)
        lp, ent = res if entropy_coef > 0 else (res, None)
        pg, clip_frac, approx_kl, weight = policy_loss(lp, mb["old_logprobs"], mb["advantages"],
                                                      mask, clip_eps=clip_eps)
        n = mask.sum()
        loss_sum = pg * n
        report = {"policy_loss_sum": loss_sum.detach(), "clip_sum": clip_frac * n,
                  "approx_kl_sum": approx_kl * n, "tokens": n}
        if ent is not None:
            ent_sum = (ent * mask).sum()
            loss_sum = loss_sum - entropy_coef * ent_sum
            report["entropy_sum"] = ent_sum.detach()
        return loss_sum, n.to(torch.int), report

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        return _run(model, mb), partial(loss_func, mb, _unwrap(model).pg_collection.tp)

    return forward_step


def critic_train_step(R: int, value_clip_eps):
    """Clipped value loss (token-mean over the mini-batch)."""

    def loss_func(mb, output):
        mask = mb["response_mask"]
        v = gather_response(output[..., 0].float(), mb["prompt_lengths"], R)
        vl, vclip, weight = value_loss(v, mb["values"], mb["returns"], mask,
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
        return _run(model, {"tokens": tokens}), partial(loss_func, tokens, _unwrap(model).pg_collection.tp)

    return forward_step
