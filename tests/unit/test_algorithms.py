"""Unit tests for puzzle.algorithms (and the stateful KL controllers and running moments of
puzzle/dataflow/ built on it). Expected numbers are worked out by hand in comments."""

import math
import random

import pytest
import torch

from puzzle.algorithms import (
    adaptive_kl_coef,
    compute_gae,
    compute_token_rewards,
    entropy_bonus,
    fold_moments,
    kl_penalty,
    last_valid_index,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    normalize_scores,
    policy_loss,
    value_loss,
)
from puzzle.dataflow.kl_controller import AdaptiveKLController, FixedKLController, build_kl_controller
from puzzle.dataflow.reward_stage import RunningMoments

F64 = torch.float64


def t(x):
    return torch.tensor(x, dtype=F64)


def close(a, b, tol=1e-6):
    torch.testing.assert_close(torch.as_tensor(a, dtype=F64), torch.as_tensor(b, dtype=F64), atol=tol, rtol=0)


# ---------------------------------------------------------------- masked ops
NAN = float("nan")
VALS = t([[1.0, 2.0, NAN, 4.0], [5.0, 6.0, 7.0, 8.0]])
MASK = t([[1, 1, 0, 0], [1, 0, 1, 0]])  # valid: 1, 2, 5, 7


def test_masked_sum_mean_var_hand():
    close(masked_sum(VALS, MASK), 15.0)
    close(masked_sum(VALS, MASK, dim=-1), [3.0, 12.0])
    close(masked_mean(VALS, MASK), 3.75)
    close(masked_mean(VALS, MASK, dim=-1), [1.5, 6.0])
    # deviations -2.75, -1.75, 1.25, 3.25 -> squares sum 22.75
    close(masked_var(VALS, MASK, unbiased=False), 22.75 / 4)
    close(masked_var(VALS, MASK, unbiased=True), 22.75 / 3)


def test_masked_mean_empty_mask_and_bool_mask():
    close(masked_mean(VALS, torch.zeros_like(MASK)), 0.0)
    close(masked_mean(VALS, MASK.bool(), dim=-1), [1.5, 6.0])
    close(masked_mean(VALS, t([[0, 0, 0, 0], [0, 1, 0, 1]]), dim=-1), [0.0, 7.0])


def test_masked_whiten_stats_only_from_valid_entries():
    out = masked_whiten(VALS, MASK)
    std = math.sqrt(22.75 / 3)
    expected = t([[(1 - 3.75) / std, (2 - 3.75) / std, 0, 0], [(5 - 3.75) / std, 0, (7 - 3.75) / std, 0]])
    close(out, expected, tol=1e-6)
    # changing invalid entries changes nothing
    other = VALS.clone()
    other[0, 3] = 1e6
    other[1, 1] = -1e6
    other[1, 3] = float("inf")
    close(masked_whiten(other, MASK), out, tol=0)
    # shift_mean=False keeps the mean
    close(masked_whiten(VALS, MASK, shift_mean=False), torch.where(MASK.bool(), expected + 3.75, t(0.0)))


def test_masked_whiten_random_matches_compressed_reference():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 7, generator=g, dtype=F64) * 3 + 2
    m = (torch.rand(5, 7, generator=g) > 0.4).to(F64)
    sel = x[m.bool()]
    ref = (x - sel.mean()) / sel.std(unbiased=True)
    close(masked_whiten(x, m), torch.where(m.bool(), ref, t(0.0)), tol=1e-6)


def test_shape_mismatch_names_argument():
    with pytest.raises(ValueError, match="mask"):
        masked_mean(VALS, MASK[:, :3])
    with pytest.raises(ValueError, match="ref_logprobs"):
        kl_penalty(t([[0.0, 0.0]]), t([[0.0]]))
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(t([[0.0, 0.0]]), t([[0.0, 0.0]]), t([[0.0]]), t([[1, 1]]))
    with pytest.raises(ValueError, match="returns"):
        value_loss(t([[0.0, 0.0]]), t([[0.0, 0.0]]), t([[0.0, 0.0, 0.0]]), t([[1, 1]]))
    with pytest.raises(ValueError, match="values"):
        compute_gae(t([[0.0, 0.0]]), t([[0.0]]), t([[1, 1]]), 1.0, 1.0)
    with pytest.raises(ValueError, match="scores"):
        compute_token_rewards(t([1.0, 2.0]), t([[0.0]]), t([[0.0]]), t([[1]]), 0.1)


# ---------------------------------------------------------------- KL estimators
LOGP = t([[-1.0, -2.0, -0.5]])
REF = t([[-1.5, -1.0, -0.5]])  # logp - ref = [0.5, -1.0, 0.0]


@pytest.mark.parametrize(
    "kind,expected",
    [
        ("k1", [0.5, -1.0, 0.0]),
        ("kl", [0.5, -1.0, 0.0]),
        ("abs", [0.5, 1.0, 0.0]),
        ("mse", [0.125, 0.5, 0.0]),
        # ref - logp = [-0.5, 1, 0]: exp(-0.5)+0.5-1, e-1-1, 0
        ("low_var_kl", [0.6065306597 - 0.5, 2.7182818285 - 2.0, 0.0]),
        ("k3", [0.6065306597 - 0.5, 2.7182818285 - 2.0, 0.0]),
    ],
)
def test_kl_penalty_hand(kind, expected):
    close(kl_penalty(LOGP, REF, kind), [expected], tol=1e-8)


def test_low_var_kl_is_clamped_and_finite():
    out = kl_penalty(t([[0.0, -30.0, -100.0]]), t([[-30.0, 0.0, 0.0]]), "low_var_kl")
    close(out, [[10.0, 10.0, 10.0]], tol=0)


def test_kl_unknown_kind():
    with pytest.raises(ValueError, match="unknown kl kind"):
        kl_penalty(LOGP, REF, "full")


# ---------------------------------------------------------------- token rewards
def _reward_inputs():
    ref = t([[-1.0, -2.0, -3.0, -4.0], [-0.5, -0.5, -0.5, -0.5], [-1.0, -1.0, -1.0, -1.0]])
    diff = t([[0.1, 0.2, 0.3, 0.4], [0.5, -0.5, 0.9, 0.9], [0.7, 0.7, 0.7, 0.7]])
    mask = t([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
    return ref + diff, ref, mask


def test_token_rewards_last_valid_token_ragged():
    logp, ref, mask = _reward_inputs()
    scores = t([1.0, -2.0, 5.0])
    rewards, kl = compute_token_rewards(scores, logp, ref, mask, kl_coef=0.1)
    close(kl, [[0.1, 0.2, 0.3, 0.0], [0.5, -0.5, 0.0, 0.0], [0.0] * 4], tol=1e-12)
    # -0.1*kl, plus score on index 2 (row 0) / index 1 (row 1); empty row gets nothing
    close(rewards, [[-0.01, -0.02, 0.97, 0.0], [-0.05, -1.95, 0.0, 0.0], [0.0] * 4], tol=1e-12)


def test_token_rewards_clip_and_holes():
    logp, ref, mask = _reward_inputs()
    rewards, _ = compute_token_rewards(t([1.0, -2.0, 5.0]), logp, ref, mask, kl_coef=0.1, clip_reward=1.5)
    close(rewards[1], [-0.05, 0.05 - 1.5, 0.0, 0.0], tol=1e-12)
    # a mask with a hole: last valid index is 2, not 0
    hole = t([[1, 0, 1, 0]])
    r, _ = compute_token_rewards(t([3.0]), t([[0.0] * 4]), t([[0.0] * 4]), hole, kl_coef=0.0)
    close(r, [[0.0, 0.0, 3.0, 0.0]], tol=0)
    assert last_valid_index(t([[1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])).tolist() == [2, -1, 3]


def test_token_rewards_bad_args():
    logp, ref, mask = _reward_inputs()
    with pytest.raises(ValueError, match="kl_coef"):
        compute_token_rewards(t([1.0, 2.0, 3.0]), logp, ref, mask, kl_coef=-0.1)
    with pytest.raises(ValueError, match="clip_reward"):
        compute_token_rewards(t([1.0, 2.0, 3.0]), logp, ref, mask, kl_coef=0.1, clip_reward=0.0)


def test_running_moments_and_normalize():
    rm = RunningMoments()
    assert (rm.mean, rm.std) == (0.0, 1.0)
    bm, bs = rm.update(t([1.0, 2.0, 3.0]))
    close([bm, bs], [2.0, 1.0], tol=1e-12)
    bm, bs = rm.update(t([4.0, 5.0]))
    close([bm, bs], [4.5, math.sqrt(0.5)], tol=1e-12)
    # statistics of 1..5: mean 3, unbiased var 2.5
    close([rm.mean, rm.std, rm.count], [3.0, math.sqrt(2.5), 5], tol=1e-12)
    rm2 = RunningMoments()
    rm2.load_state_dict(rm.state_dict())
    close(rm2.normalize(t([3.0, 5.5]), update=False), [0.0, 2.5 / math.sqrt(2.5)], tol=1e-6)
    close(normalize_scores(t([2.0, 0.0]), 1.0, 2.0), [0.5, -0.5], tol=1e-6)
    flat = RunningMoments()  # every score equal so far: centred, not divided by ~0
    close(flat.normalize(t([0.0, 0.0, 0.0])), [0.0, 0.0, 0.0])
    close(flat.normalize(t([1.0]), update=False), [1.0], tol=1e-6)


def test_fold_moments_is_pure():
    # 1, 2, 3 folded into the moments of 4, 5 (mean 4.5, m2 0.5): 1..5 has mean 3, m2 10
    assert fold_moments(4.5, 0.5, 2, t([1.0, 2.0, 3.0])) == (3.0, 10.0, 5, 2.0, 1.0)
    assert fold_moments(4.5, 0.5, 2, t([])) == (4.5, 0.5, 2, 0.0, 0.0)
    with pytest.raises(ValueError, match="NaN/inf"):
        fold_moments(0.0, 0.0, 0, t([1.0, NAN]))


# ---------------------------------------------------------------- GAE
def test_gae_hand_1x3():
    adv, ret = compute_gae(t([[1.0, 0.0, 2.0]]), t([[0.5, 1.0, 1.5]]), t([[1, 1, 1]]), 0.9, 0.8, whiten_advantages=False)
    # A2 = 2 - 1.5 = 0.5; A1 = 0 + .9*1.5 - 1 + .72*.5 = 0.71; A0 = 1 + .9 - .5 + .72*.71 = 1.9112
    close(adv, [[1.9112, 0.71, 0.5]], tol=1e-12)
    close(ret, [[2.4112, 1.71, 2.0]], tol=1e-12)


def test_gae_hand_trailing_padding_does_not_leak():
    adv, ret = compute_gae(
        t([[1.0, 0.0, 100.0]]), t([[0.5, 1.0, 100.0]]), t([[1, 1, 0]]), 0.9, 0.8, whiten_advantages=False
    )
    # bootstrap 0 after index 1: A1 = 0 - 1 = -1; A0 = 1 + .9*1 - .5 + .72*(-1) = 0.68
    close(adv, [[0.68, -1.0, 0.0]], tol=1e-12)
    close(ret, [[1.18, 0.0, 0.0]], tol=1e-12)


def _gae_reference(rewards, values, mask, gamma, lam):
    B, R = len(rewards), len(rewards[0])
    adv = [[0.0] * R for _ in range(B)]
    ret = [[0.0] * R for _ in range(B)]
    for b in range(B):
        idx = [i for i in range(R) if mask[b][i]]
        gae, next_v = 0.0, 0.0
        for i in reversed(idx):
            delta = rewards[b][i] + gamma * next_v - values[b][i]
            gae = delta + gamma * lam * gae
            adv[b][i], ret[b][i] = gae, gae + values[b][i]
            next_v = values[b][i]
    return adv, ret


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gae_random_ragged_matches_reference_loop(seed):
    rng = random.Random(seed)
    B, R = 4, 9
    rewards = [[rng.gauss(0, 1) for _ in range(R)] for _ in range(B)]
    values = [[rng.gauss(0, 1) for _ in range(R)] for _ in range(B)]
    mask = []
    for b in range(B):
        length = rng.randint(0, R) if b else 0  # row 0 empty
        row = [1 if i < length else 0 for i in range(R)]
        if length > 2:
            row[rng.randrange(1, length - 1)] = 0  # a hole inside the response
        mask.append(row)
    gamma, lam = rng.uniform(0.8, 1.0), rng.uniform(0.8, 1.0)
    ref_adv, ref_ret = _gae_reference(rewards, values, mask, gamma, lam)
    m = t(mask)
    r_garbage = torch.where(m.bool(), t(rewards), t(1e9))  # garbage at invalid positions
    adv, ret = compute_gae(r_garbage, t(values), m, gamma, lam, whiten_advantages=False)
    close(adv, ref_adv, tol=1e-9)
    close(ret, ref_ret, tol=1e-9)
    wadv, wret = compute_gae(t(rewards), t(values), m, gamma, lam, whiten_advantages=True)
    sel = t(ref_adv)[m.bool()]
    close(wadv, torch.where(m.bool(), (t(ref_adv) - sel.mean()) / sel.std(), t(0.0)), tol=1e-6)
    close(wret, ref_ret, tol=1e-9)


def test_gae_bad_gamma():
    with pytest.raises(ValueError, match="lam"):
        compute_gae(t([[0.0]]), t([[0.0]]), t([[1]]), 0.9, 1.5)


# ---------------------------------------------------------------- policy loss
OLD = t([[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
NEW = t([[math.log(1.5), math.log(0.5), math.log(1.1), 3.0], [math.log(0.5), math.log(1.5), 9.0, -9.0]])
ADV = t([[1.0, -1.0, 2.0, 50.0], [1.0, -1.0, 7.0, 7.0]])
PMASK = t([[1, 1, 1, 0], [1, 1, 0, 0]])
# per-token loss: row0: max(-1.5,-1.2)=-1.2 (clip), max(.5,.8)=.8 (clip), -2.2
#                 row1: max(-.5,-.8)=-.5, max(1.5,1.2)=1.5   -> sum -1.6 over 5 tokens


def test_policy_loss_hand_1x3():
    lp = NEW[:1, :3].clone().requires_grad_(True)
    loss, clip_frac, approx_kl, weight = policy_loss(lp, OLD[:1, :3], ADV[:1, :3], PMASK[:1, :3], clip_eps=0.2)
    close(loss, -2.6 / 3, tol=1e-9)
    close(clip_frac, 2 / 3, tol=1e-9)
    # ratio - 1 - log(ratio): .5-.405465108 + (-.5+.693147181) + (.1-.0953101798)
    close(approx_kl, (0.094534892 + 0.193147181 + 0.0046898202) / 3, tol=1e-8)
    close(weight, 3.0, tol=0)


def test_policy_loss_hand_2x4_masked_and_agg_modes():
    loss, clip_frac, _, weight = policy_loss(NEW, OLD, ADV, PMASK, clip_eps=0.2)
    close(loss, -1.6 / 5, tol=1e-9)
    close(clip_frac, 2 / 5, tol=1e-9)
    close(weight, 5.0, tol=0)
    loss, _, _, weight = policy_loss(NEW, OLD, ADV, PMASK, 0.2, loss_agg="seq-mean-token-mean")
    close(loss, (-2.6 / 3 + 1.0 / 2) / 2, tol=1e-9)
    close(weight, 2.0, tol=0)
    loss, _, _, _ = policy_loss(NEW, OLD, ADV, PMASK, 0.2, loss_agg="seq-mean-token-sum")
    close(loss, (-2.6 + 1.0) / 2, tol=1e-9)
    with pytest.raises(ValueError, match="loss_agg"):
        policy_loss(NEW, OLD, ADV, PMASK, 0.2, loss_agg="sum")


def test_policy_loss_micro_batch_aggregation_is_exact():
    parts = [policy_loss(NEW[i : i + 1], OLD[i : i + 1], ADV[i : i + 1], PMASK[i : i + 1], 0.2) for i in range(2)]
    num = sum(p[0] * p[3] for p in parts)
    den = sum(p[3] for p in parts)
    close(num / den, -0.32, tol=1e-9)
    # a naive mean of micro-batch means would be wrong here: (-2.6/3 + 0.5) / 2
    assert abs(float(sum(p[0] for p in parts) / 2) - (-0.32)) > 1e-3
    summed = sum(policy_loss(NEW[i : i + 1], OLD[i : i + 1], ADV[i : i + 1], PMASK[i : i + 1], 0.2, denominator=5)[0]
                 for i in range(2))
    close(summed, -0.32, tol=1e-9)


def test_policy_loss_grads_only_through_logprobs():
    lp = NEW[:1, :3].clone().requires_grad_(True)
    old = OLD[:1, :3].clone().requires_grad_(True)
    adv = ADV[:1, :3].clone().requires_grad_(True)
    loss, clip_frac, approx_kl, _ = policy_loss(lp, old, adv, PMASK[:1, :3], 0.2)
    loss.backward()
    assert old.grad is None and adv.grad is None
    assert not clip_frac.requires_grad and not approx_kl.requires_grad
    # clipped tokens 0, 1 get no gradient; token 2: d/dlp (-A * exp(lp)) / 3 = -2 * 1.1 / 3
    close(lp.grad, [[0.0, 0.0, -2.2 / 3]], tol=1e-9)


def test_policy_loss_masked_tokens_get_zero_grad():
    new = NEW.clone()
    new[1, 3] = float("nan")  # NaN padding must not poison loss or grads
    old = OLD.clone()
    old[1, 2] = float("-inf")
    lp = new.requires_grad_(True)
    loss = policy_loss(lp, old, ADV, PMASK, 0.2)[0]
    close(loss, -0.32, tol=1e-9)
    loss.backward()
    assert torch.isfinite(lp.grad).all()
    assert (lp.grad[PMASK == 0] == 0).all()


def test_whiten_grad_ignores_nan_padding():
    x = VALS.clone().requires_grad_(True)
    masked_whiten(x, MASK).square().sum().backward()
    assert torch.isfinite(x.grad).all() and (x.grad[MASK == 0] == 0).all()


# ---------------------------------------------------------------- value loss
def test_value_loss_hand_clipping():
    v = t([[1.5, 0.5, 2.0]]).requires_grad_(True)
    old, ret, m = t([[1.0, 1.0, 1.0]]), t([[2.0, 0.0, 1.0]]), t([[1, 1, 1]])
    loss, clip_frac, weight = value_loss(v, old, ret, m, value_clip_eps=0.2)
    # max(.25, .64), max(.25, .64), max(1.0, .04) -> 0.5 * 2.28 / 3
    close(loss, 0.38, tol=1e-9)
    close(clip_frac, 2 / 3, tol=1e-9)
    close(weight, 3.0, tol=0)
    loss.backward()
    close(v.grad, [[0.0, 0.0, 1.0 / 3]], tol=1e-9)  # 0.5 * 2 * (2 - 1) / 3
    loss, clip_frac, _ = value_loss(v, old, ret, m, value_clip_eps=None)
    close(loss, 0.5 * 1.5 / 3, tol=1e-9)
    close(clip_frac, 0.0, tol=0)


def test_value_loss_masked():
    v = t([[1.5, 0.5, 2.0, 9.0], [3.0, 0.0, 0.0, 0.0]])
    old = t([[1.0, 1.0, 1.0, 0.0], [3.1, 0.0, 0.0, 0.0]])
    ret = t([[2.0, 0.0, 1.0, -9.0], [3.0, 0.0, 0.0, 0.0]])
    m = t([[1, 1, 1, 0], [1, 0, 0, 0]])
    # row1 token: v - old = -0.1 inside clip range -> both errors 0
    v[0, 3] = float("nan")
    loss, clip_frac, weight = value_loss(v, old, ret, m, 0.2)
    close(loss, 0.5 * 2.28 / 4, tol=1e-9)
    close(clip_frac, 2 / 4, tol=1e-9)
    close(weight, 4.0, tol=0)


def test_entropy_bonus():
    ent = t([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    close(entropy_bonus(ent, MASK), 3.75, tol=1e-12)
    close(entropy_bonus(ent, MASK, denominator=10), 1.5, tol=1e-12)


# ---------------------------------------------------------------- KL controllers
def test_adaptive_kl_coef_hand():
    assert adaptive_kl_coef(0.1, 9.0, 6.0, 10000, 500) == 0.1 * 1.01  # e = .5 -> .2; 1 + .2*500/1e4
    assert adaptive_kl_coef(0.1, 6.0, 6.0, 10000, 500) == 0.1  # on target: unchanged
    assert adaptive_kl_coef(0.1, 3.0, 6.0, 10000, 1000) == 0.1 * 0.98  # e = -.5 -> -.2


def test_adaptive_kl_controller_hand():
    c = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    c.update(9.0, n_steps=500)  # e = .5 -> .2; mult = 1 + .2*500/1e4 = 1.01
    close(c.value, 0.101, tol=1e-12)
    c.update(3.0, n_steps=1000)  # e = -.5 -> -.2; mult = .98
    close(c.value, 0.09898, tol=1e-12)
    c.update(torch.tensor(6.6), n_steps=2000)  # e = .1; mult = 1.02
    close(c.value, 0.1009596, tol=1e-9)
    c2 = AdaptiveKLController(0.5, target=6.0, horizon=10000)
    c2.load_state_dict(c.state_dict())
    close(c2.value, 0.1009596, tol=1e-9)


def test_fixed_kl_controller_and_builder():
    f = FixedKLController(0.05)
    f.update(100.0, 1000)
    assert f.value == 0.05
    with pytest.raises(ValueError):
        f.load_state_dict(AdaptiveKLController(0.1, 1.0, 1.0).state_dict())
    assert isinstance(build_kl_controller(0.05), FixedKLController)
    a = build_kl_controller(0.05, kl_target=6.0, kl_horizon=100)
    assert isinstance(a, AdaptiveKLController) and a.horizon == 100 and a.target == 6.0
    assert build_kl_controller(0.05, kl_target=6.0).horizon == 10000


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(kl_coef=-0.1), "kl_coef"),
        (dict(kl_coef=float("nan")), "kl_coef"),
        (dict(kl_coef=0.1, kl_target=6.0, kl_horizon=0), "kl_horizon"),
        (dict(kl_coef=0.1, kl_target=6.0, kl_horizon=-5), "kl_horizon"),
        (dict(kl_coef=0.1, kl_target=0.0), "kl_target"),
    ],
)
def test_build_kl_controller_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_kl_controller(**kwargs)


def test_adaptive_update_rejects_nan():
    c = AdaptiveKLController(0.1, 6.0, 10000)
    with pytest.raises(ValueError, match="current_kl"):
        c.update(float("nan"), 10)
    assert c.value == 0.1
