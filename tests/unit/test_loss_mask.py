"""Multi-turn masks: observation tokens (loss_mask 0) are in the sequence but carry no loss, no
KL, no value target and no advantage (RolloutBatch.response_mask folds the loss mask in)."""

from types import SimpleNamespace

import pytest
import torch

from puzzle.algorithms.advantage_estimators import compute_advantages
from puzzle.algorithms.token_rewards import compute_token_rewards
from puzzle.dataflow.batch import RolloutBatch
from puzzle.dataflow.micro_batching import micro_batches
from puzzle.dataflow.steps import actor_train_step, critic_train_step

V, R = 11, 6


class TinyLM(torch.nn.Module):
    def __init__(self, out=V):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = torch.nn.Embedding(V, 8), torch.nn.Linear(8, out)
        self.puzzle_device, self.pg_collection = torch.device("cpu"), SimpleNamespace(tp=None)

    def forward(self, tokens, positions, mask, **kw):
        return self.head(self.emb(tokens))


def batch(loss_mask, obs_value=0.0):
    """Two rows (prompt 2 tokens; responses of 6 and 4), row 0's response columns 2-3 observations;
    ``obs_value`` written into every per-token field at the observation columns."""
    torch.manual_seed(1)
    tokens = torch.randint(0, V, (2, 2 + R))
    obs = torch.zeros(2, R, dtype=torch.bool)
    obs[0, 2:4] = True
    fields = {k: torch.where(obs, torch.full((2, R), obs_value), torch.randn(2, R))
              for k in ("old_logprobs", "advantages", "values", "returns")}
    return RolloutBatch(tokens, torch.tensor([2, 2]), torch.tensor([6, 4]), R, loss_mask=loss_mask, **fields)


def grads(b, step):
    model = TinyLM(1 if step is critic_train_step else V)
    fwd = critic_train_step(R, None) if step is critic_train_step else actor_train_step(V, 1.0, R, 0.2, 0.0)
    mb, = micro_batches(b, 2)
    out, loss_func = fwd(iter([mb]), model)
    loss, n, report = loss_func(out)
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()]), int(n)


OBS_MASK = torch.ones(2, R)
OBS_MASK[0, 2:4] = 0.0


@pytest.mark.parametrize("step", [actor_train_step, critic_train_step])
def test_observation_tokens_carry_no_gradient(step):
    g, n = grads(batch(OBS_MASK), step)
    assert n == 8 and g.abs().sum() > 0  # 10 response tokens, 2 of them observations
    g_far, _ = grads(batch(OBS_MASK, obs_value=1e6), step)  # whatever the observations hold
    assert torch.equal(g, g_far)
    zero, n = grads(batch(OBS_MASK * 0), step)  # the loss mask's model tokens zeroed too
    assert n == 0 and torch.equal(zero, torch.zeros_like(zero))


def test_observation_tokens_get_no_kl_and_no_advantage():
    b = batch(OBS_MASK)
    mask = b.response_mask
    assert mask[0].tolist() == [1, 1, 0, 0, 1, 1] and mask[1].tolist() == [1, 1, 1, 1, 0, 0]
    ref = b.old_logprobs + 0.3
    rewards, kl = compute_token_rewards(torch.tensor([1.0, 0.0]), b.old_logprobs, ref, mask, kl_coef=0.1)
    adv, ret = compute_advantages("gae", rewards, mask, values=b.values, gamma=1.0, lam=0.95)
    for t in (kl, rewards, adv, ret):
        assert torch.equal(t[0, 2:4], torch.zeros(2))
    assert rewards[0, 5] != 0  # the score on the last model token, after the observation


# --rl-partial-rollouts-max-staleness: row 1's first two tokens are stale (policy_loss_mask 0)
STALE = torch.ones(2, R)
STALE[1, :2] = 0.0


def stale_batch(policy_loss_mask, stale_value=None):
    """``batch(OBS_MASK)`` with the fields the actor's full loss reads (behaviour and reference
    log-probs); ``stale_value`` written into every per-token field at the stale tokens."""
    b = batch(OBS_MASK)
    torch.manual_seed(2)
    extra = {"gen_logprobs": b.old_logprobs - 0.1 * torch.rand(2, R), "ref_logprobs": torch.randn(2, R)}
    fields = {**{k: getattr(b, k) for k in ("old_logprobs", "advantages", "values", "returns")}, **extra}
    if stale_value is not None:
        fields = {k: torch.where(STALE == 0, torch.full_like(v, stale_value), v) for k, v in fields.items()}
    return RolloutBatch(b.tokens, b.prompt_lengths, b.response_lengths, R, loss_mask=OBS_MASK,
                        policy_loss_mask=policy_loss_mask, **fields)


def full_grads(b, critic=False):
    """Gradients of the actor's loss with every term (clipped surrogate with importance weights,
    entropy bonus, KL loss), or of the critic's."""
    model = TinyLM(1 if critic else V)
    fwd = critic_train_step(R, None) if critic else actor_train_step(
        V, 1.0, R, 0.2, 0.05, use_kl_loss=True, kl_loss_coef=0.1, is_correction=True)
    mb, = micro_batches(b, 2)
    out, loss_func = fwd(iter([mb]), model)
    loss, n, report = loss_func(out)
    loss.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()]), int(n), report


def test_stale_tokens_get_no_actor_loss_and_stay_in_the_critics():
    g, n, report = full_grads(stale_batch(STALE))
    assert n == 6 and int(report["tokens"]) == 6 and g.abs().sum() > 0  # 8 model tokens, 2 of them stale
    g_far, _, _ = full_grads(stale_batch(STALE, stale_value=1e3))  # whatever the stale tokens hold
    assert torch.allclose(g, g_far, rtol=0, atol=1e-7)
    g_all, n_all, _ = full_grads(stale_batch(None))
    assert n_all == 8 and not torch.allclose(g, g_all)
    # the same as a loss mask of the stale tokens, but the batch's response mask (advantages, KL,
    # critic) keeps them
    b = stale_batch(STALE)
    assert b.response_mask.sum() == 8
    fields = {k: v for k, v in b.fields.items() if "mask" not in k}
    folded, _, _ = full_grads(RolloutBatch(b.tokens, b.prompt_lengths, b.response_lengths, R,
                                           loss_mask=OBS_MASK * STALE, **fields))
    assert torch.allclose(g, folded, rtol=0, atol=1e-7)
    c, cn, _ = full_grads(stale_batch(STALE), critic=True)
    c_all, _, _ = full_grads(stale_batch(None), critic=True)
    assert cn == 8 and torch.equal(c, c_all)


def test_a_mini_batch_with_every_token_stale_skips_the_actors_step():
    from puzzle.dataflow.training_stage import nothing_to_train

    rows = torch.tensor([1])
    assert nothing_to_train(stale_batch(None), rows) == set()  # without the flag: never
    assert nothing_to_train(stale_batch(STALE), rows) == set()  # row 1 keeps 2 tokens
    row1_stale = STALE.clone()
    row1_stale[1] = 0.0
    assert nothing_to_train(stale_batch(row1_stale), rows) == {"actor"}
    assert nothing_to_train(stale_batch(row1_stale), torch.tensor([0, 1])) == set()
    only_after = torch.ones(2, R)
    only_after[1, :4] = 0.0  # row 1's response is 4 tokens: its trained positions are all after it
    assert nothing_to_train(stale_batch(only_after), rows) == {"actor"}
