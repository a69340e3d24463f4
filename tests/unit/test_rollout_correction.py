"""The generation-vs-scoring log-prob of sampled tokens and the truncated importance-sampling
correction (puzzle/algorithms/rollout_correction.py, puzzle/rollout/sampling.py sampled_logprobs)."""

import math

import pytest
import torch

from puzzle.algorithms import policy_loss
from puzzle.algorithms.rollout_correction import logprob_diff_stats, mismatch_metrics, truncated_is_weights
from puzzle.arguments import ArgumentError, parse_args, validate_args
from puzzle.rollout.sampling import SamplingParams, sample_tokens, sampled_logprobs
from puzzle.engine.vocab_parallel import vocab_parallel_logprobs
from tests.unit.test_arguments import BASE

V_TRUE, V_PAD = 200, 256


def _logits(n=6, seed=0):
    return torch.randn(n, V_PAD, generator=torch.Generator().manual_seed(seed)) * 3.0


@pytest.mark.parametrize("kw", [dict(temperature=0.7, top_k=5, top_p=0.8), dict(temperature=1.0),
                                dict(greedy=True, temperature=0.5)])
def test_generation_logprob_is_scorings_bit_for_bit_on_the_same_logits(kw):
    """Same logits -> the recorded log-prob IS scoring's (exact 0): temperature-scaled, padding
    masked, the top-k/top-p filter not applied (greedy: temperature 1, as scoring does)."""
    params = SamplingParams(max_new_tokens=4, **kw)
    x = _logits()
    tok = sample_tokens(x, params, true_vocab=V_TRUE, seed=3)
    lp = sampled_logprobs(x, tok, params, true_vocab=V_TRUE)
    temp = 1.0 if params.greedy else params.temperature
    rows = x.unsqueeze(0)  # scoring's [b, s, V] from the same logits
    score = vocab_parallel_logprobs(rows, tok.unsqueeze(0), None, V_TRUE, temperature=temp)[0]
    assert lp.dtype == torch.float32 and torch.equal(lp, score)
    ref = torch.log_softmax(x[:, :V_TRUE].double() / temp, dim=-1).gather(1, tok.unsqueeze(1)).squeeze(1)
    assert torch.allclose(lp.double(), ref, atol=1e-5)
    if params.top_k:  # the filtered distribution would put more mass on each kept token
        lse_top = torch.logsumexp(x[:, :V_TRUE].topk(5).values / temp, dim=-1)
        filtered = x.gather(1, tok.unsqueeze(1)).squeeze(1) / temp - lse_top
        assert (filtered > lp).all()


def test_diff_stats_hand():
    gen = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, 9.0, 9.0]])
    score = torch.tensor([[-1.5, -2.0, -2.0], [-0.25, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    dmax, dmean = logprob_diff_stats(gen, score, mask)
    assert float(dmax) == 1.0 and float(dmean) == pytest.approx((0.5 + 0 + 1 + 0.25) / 4)
    assert [float(v) for v in logprob_diff_stats(gen, score, torch.zeros_like(mask))] == [0.0, 0.0]


def test_truncated_is_weights_hand():
    old = torch.tensor([[0.0, math.log(3.0), -1.0, 50.0]])
    gen = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    w, cut = truncated_is_weights(old, gen, mask)  # untruncated
    assert torch.allclose(w, torch.tensor([[1.0, 3.0, math.exp(-1.0), 1.0]])) and float(cut.sum()) == 0
    w, cut = truncated_is_weights(old, gen, mask, truncation_coef=2.0)
    assert torch.allclose(w, torch.tensor([[1.0, 2.0, math.exp(-1.0), 1.0]]))
    assert cut.tolist() == [[0.0, 1.0, 0.0, 0.0]]  # the masked token's huge ratio is neither kept nor counted
    with pytest.raises(ValueError, match="truncation_coef"):
        truncated_is_weights(old, gen, mask, truncation_coef=0.0)
    m = mismatch_metrics(gen, old, mask, is_correction=True, truncation_coef=2.0)
    assert m["is_truncated_frac"] == pytest.approx(1 / 3)
    assert m["is_weight_mean"] == pytest.approx((1 + 2 + math.exp(-1)) / 3)
    assert m["gen_score_logprob_diff_max"] == pytest.approx(math.log(3.0))
    assert set(mismatch_metrics(gen, old, mask)) == {"gen_score_logprob_diff_max", "gen_score_logprob_diff_mean"}


def test_policy_loss_token_weights():
    g = torch.Generator().manual_seed(1)
    lp, old, adv = (torch.randn(3, 5, generator=g) for _ in range(3))
    mask = (torch.rand(3, 5, generator=g) > 0.3).float()
    plain = policy_loss(lp, old, adv, mask)
    ones = policy_loss(lp, old, adv, mask, token_weights=torch.ones(3, 5))
    assert all(torch.equal(a, b) for a, b in zip(plain, ones))  # weights 1: the same numbers
    w = torch.rand(3, 5, generator=g) * 2
    weighted = policy_loss(lp, old, adv, mask, token_weights=w)
    per_token = policy_loss(lp, old, adv, mask, loss_agg="seq-mean-token-sum", denominator=1.0)
    ref_mat = torch.maximum(-adv * torch.exp(lp - old), -adv * torch.exp(lp - old).clamp(0.8, 1.2))
    assert float(weighted[0]) == pytest.approx(float((ref_mat * w * mask).sum() / mask.sum()), rel=1e-6)
    assert per_token[0].isfinite()
    assert torch.equal(weighted[1], plain[1]) and torch.equal(weighted[2], plain[2])  # clip_frac, approx_kl


def _cfg(argv):
    try:
        return validate_args(parse_args(BASE + argv), 4, 259)
    except ArgumentError as e:
        return str(e)


def test_flags():
    ppo = _cfg([]).ppo
    assert not ppo.rl_inference_logprobs_is_correction and ppo.rl_importance_sampling_truncation_coef is None
    ppo = _cfg(["--rl-inference-logprobs-is-correction", "--rl-importance-sampling-truncation-coef", "2"]).ppo
    assert ppo.rl_inference_logprobs_is_correction and ppo.rl_importance_sampling_truncation_coef == 2.0
    assert "needs --rl-inference-logprobs-is-correction" in _cfg(["--rl-importance-sampling-truncation-coef", "2"])
    assert "must be > 0" in _cfg(["--rl-inference-logprobs-is-correction",
                                  "--rl-importance-sampling-truncation-coef", "0"])
