"""Vocab-parallel sampling at T=1 (tp_group=None) against direct references."""

import math

import pytest
import torch

from puzzle.rollout.sampling import (SamplingParams, gumbel_noise, sample_tokens, top_k_filter,
                                     top_p_filter, uniform_noise, vocab_parallel_argmax)

V_TRUE, V_PAD = 200, 256


def _logits(n=6, seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, V_PAD, generator=g) * scale


def test_params_validation():
    SamplingParams(max_new_tokens=4, temperature=0.5, top_k=3, top_p=0.9, eos_id=2)
    for kwargs in [dict(max_new_tokens=0), dict(max_new_tokens=4, temperature=0.0),
                   dict(max_new_tokens=4, temperature=float("inf")), dict(max_new_tokens=4, top_k=-1),
                   dict(max_new_tokens=4, top_p=0.0), dict(max_new_tokens=4, top_p=1.5),
                   dict(max_new_tokens=4, eos_id=-3), dict(max_new_tokens=2.5)]:
        with pytest.raises(ValueError, match="invalid SamplingParams"):
            SamplingParams(**kwargs)


def test_greedy_is_argmax_over_true_vocab_lowest_id_on_ties():
    x = _logits()
    x[:, V_TRUE:] = 100.0  # padding ids never win
    x[0, 7] = x[0, 3] = 50.0  # tie -> lowest id
    tok = sample_tokens(x, SamplingParams(4, greedy=True), true_vocab=V_TRUE)
    ref = x[:, :V_TRUE].argmax(-1)
    assert tok.tolist() == ref.tolist() and tok[0] == 3
    # the argmax primitive on its own
    assert vocab_parallel_argmax(x[:, :V_TRUE], 0, None).tolist() == ref.tolist()


def test_top_k_matches_torch_topk():
    x = _logits()
    for k in (1, 5, 50):
        kept = torch.isfinite(top_k_filter(x, k, None))
        ref = torch.zeros_like(kept).scatter_(1, x.topk(k, -1).indices, True)
        assert torch.equal(kept, ref), k


def _nucleus_reference(x, p):
    probs = torch.softmax(x.double(), -1)
    sp, si = probs.sort(-1, descending=True)
    before = sp.cumsum(-1) - sp  # mass strictly before each token in sorted order
    keep_sorted = before < p
    return torch.zeros_like(keep_sorted).scatter_(1, si, keep_sorted)


@pytest.mark.parametrize("p", [0.05, 0.3, 0.9, 0.999])
def test_top_p_exact_against_sorting(p):
    for scale in (0.3, 2.0, 8.0):
        x = _logits(scale=scale, seed=int(scale * 10))
        kept = torch.isfinite(top_p_filter(x, p, None))
        assert torch.equal(kept, _nucleus_reference(x, p)), (p, scale)
        assert kept.sum(-1).min() >= 1


def test_top_p_after_top_k_and_padding():
    x = _logits(scale=1.0)
    x[:, V_TRUE:] = float("-inf")
    y = top_p_filter(top_k_filter(x, 20, None), 0.5, None)
    ref = _nucleus_reference(top_k_filter(x, 20, None), 0.5)
    assert torch.equal(torch.isfinite(y), ref)
    assert not torch.isfinite(y[:, V_TRUE:]).any()


def test_padding_ids_never_sampled():
    x = torch.zeros(64, V_PAD)
    x[:, V_TRUE:] = 30.0  # would dominate if not masked
    for params in [SamplingParams(4), SamplingParams(4, temperature=3.0, top_k=250),
                   SamplingParams(4, top_p=0.99)]:
        tok = sample_tokens(x, params, true_vocab=V_TRUE, seed=5, sample_ids=torch.arange(64))
        assert int(tok.max()) < V_TRUE


def test_noise_is_a_function_of_seed_sample_step_vocab_only():
    ids = torch.tensor([0, 1, 7, 2**33 + 5])
    full = uniform_noise(11, ids, 3, 0, V_PAD)
    assert full.shape == (4, V_PAD) and full.dtype == torch.float64
    assert 0 < float(full.min()) and float(full.max()) < 1
    # each TP rank hashes only its slice: slices of the full table
    assert torch.equal(uniform_noise(11, ids, 3, 128, 256), full[:, 128:])
    assert torch.equal(uniform_noise(11, ids[2:3], 3, 0, V_PAD), full[2:3])  # batch-independent
    assert torch.equal(uniform_noise(11, ids, torch.tensor([3, 3, 3, 3]), 0, V_PAD), full)
    for other in (uniform_noise(12, ids, 3, 0, V_PAD), uniform_noise(11, ids, 4, 0, V_PAD),
                  uniform_noise(11 + 2**32, ids, 3, 0, V_PAD)):
        assert (other != full).float().mean() > 0.99
    # roughly uniform, and the Gumbel transform has the right mean (Euler's constant)
    big = uniform_noise(1, torch.arange(400), 0, 0, 1000)
    assert abs(float(big.mean()) - 0.5) < 0.01
    assert abs(float(gumbel_noise(1, torch.arange(400), 0, 0, 1000).mean()) - 0.5772) < 0.02


def test_sampling_follows_the_filtered_distribution():
    x = torch.full((1, 16), -5.0)  # a small vocabulary: 12 true ids + 4 padding
    x[0, 12:] = 9.0
    x[0, :6] = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5])
    n = 20000
    logits = x.expand(n, -1)
    params = SamplingParams(4, temperature=0.8, top_k=5, top_p=0.9)
    tok = sample_tokens(logits, params, true_vocab=12, seed=3, sample_ids=torch.arange(n))
    filt = top_p_filter(top_k_filter(x[:, :12] / 0.8, 5, None), 0.9, None)
    probs = torch.softmax(filt.double(), -1)[0]
    counts = torch.bincount(tok, minlength=12).double() / n
    assert set(tok.unique().tolist()) <= set(torch.nonzero(probs > 0).squeeze(1).tolist())
    assert float((counts - probs).abs().max()) < 0.015
    # deterministic
    again = sample_tokens(logits, params, true_vocab=12, seed=3, sample_ids=torch.arange(n))
    assert torch.equal(tok, again)
    assert not torch.equal(tok, sample_tokens(logits, params, true_vocab=12, seed=4,
                                              sample_ids=torch.arange(n)))
    assert math.isclose(float(probs.sum()), 1.0)


def test_graph_safe_sampling_gives_the_same_tokens():
    """The host-sync-free form (seed in a tensor, top-p's fixed 33 rounds) a CUDA graph holds."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 50, generator=g) * 3
    logits[2] = 0.0  # ties everywhere
    ids, steps = torch.arange(10, 16), torch.tensor([0, 1, 2, 3, 4, 5])
    for prm in (SamplingParams(4, greedy=True), SamplingParams(4, temperature=0.7, top_k=20, top_p=0.9),
                SamplingParams(4, top_p=0.3)):
        a = sample_tokens(logits, prm, true_vocab=48, seed=2 ** 40 + 7, sample_ids=ids, step=steps)
        b = sample_tokens(logits, prm, true_vocab=48, seed=torch.tensor([2 ** 40 + 7]), sample_ids=ids,
                          step=steps, graph_safe=True)
        assert torch.equal(a, b), prm
    c = sample_tokens(logits, SamplingParams(4), true_vocab=48, seed=torch.tensor([8]), sample_ids=ids, step=steps)
    d = sample_tokens(logits, SamplingParams(4), true_vocab=48, seed=torch.tensor([9]), sample_ids=ids, step=steps)
    assert not torch.equal(c, d)  # the seed tensor is read
