"""Rewards per turn (multi-turn episodes): each environment step's reward at the last token of its
turn. GAE (critic values on the model's tokens only) credits a turn's reward from its turn on; the
GRPO family reads the row's sum, the episode's score, unchanged."""

import torch

from puzzle.algorithms.advantage_estimators import compute_advantages
from puzzle.algorithms.token_rewards import compute_token_rewards
from puzzle.data.tokenizers import ByteTokenizer
from puzzle.dataflow.env_turns import EpisodeTurns
from puzzle.reward_functions.env_runner import EnvRunner
from puzzle.reward_functions.environments import EnvSpec


class TurnRewards:
    """Each turn gets its own length as reward; the second turn ends the episode."""

    def reset(self, record):
        self.n = 0

    def step(self, turn):
        self.n += 1
        return "ok", float(len(turn.token_ids)), self.n >= 2


def test_the_episodes_place_each_steps_reward_at_its_turns_last_token():
    tok = ByteTokenizer()
    ep = EpisodeTurns(EnvRunner(EnvSpec.of(f"{__name__}:TurnRewards")), tok, [[1], [2]], [{}, {}], 3, 16, [[59]])
    assert ep.step([0, 1], [[7, 59], [7, 7, 59]], [[], []], [False, False]) == [tok.encode("ok")] * 2
    assert ep.step([1], [[8, 59]], [[7, 7, 59, 111, 107]], [False]) == [None]  # turn 2 of row 1: cols 5, 6
    per_turn = ep.turn_rewards(9)
    assert per_turn[0].tolist() == [0, 2.0] + [0] * 7
    assert per_turn[1].tolist() == [0, 0, 3.0, 0, 0, 0, 2.0, 0, 0]
    assert [s for s, _ in ep.scores()] == [2.0, 5.0] == per_turn.sum(dim=1).tolist()


def test_gae_credits_each_turn_and_grpo_reads_the_sum():
    # one row: model tokens 0-1 (turn 1, reward 0.25 at 1), observation 2-3 (mask 0), model 4-5 (the end)
    mask = torch.tensor([[1.0, 1, 0, 0, 1, 1]])
    zeros = torch.zeros(1, 6)
    turn = torch.tensor([[0.0, 0.25, 0, 0, 0, 0]])
    placed, _ = compute_token_rewards(torch.tensor([1.0]), zeros, zeros, mask, 0.0, turn_rewards=turn)
    assert placed.tolist() == [[0.0, 0.25, 0, 0, 0, 0.75]]  # the rest of the score on the last token
    at_end, _ = compute_token_rewards(torch.tensor([1.0]), zeros, zeros, mask, 0.0)
    values = torch.tensor([[0.1, 0.2, 9.0, 9.0, 0.3, 0.4]])  # the observation's values are never read
    kw = dict(values=values, gamma=0.5, lam=1.0, whiten_advantages=False)
    adv, ret = compute_advantages("gae", placed, mask, **kw)
    # returns over the model's tokens only, discounted per model token: the observation is skipped
    expect = [0.5 * (0.25 + 0.5 * 0.375), 0.25 + 0.5 * 0.375, 0, 0, 0.5 * 0.75, 0.75]
    assert torch.allclose(ret * mask, torch.tensor([expect]) * mask)
    assert torch.allclose(adv * mask, (ret - values) * mask)
    end_adv, _ = compute_advantages("gae", at_end, mask, **kw)
    assert not torch.allclose(adv * mask, end_adv * mask)  # the turn's reward is credited earlier
    rows = torch.cat([placed, 0.5 * placed]), torch.cat([at_end, 0.5 * at_end])
    group = torch.tensor([0, 0])
    two = torch.cat([mask, mask])
    g1, _ = compute_advantages("grpo", rows[0], two, group_index=group)
    g2, _ = compute_advantages("grpo", rows[1], two, group_index=group)
    assert torch.equal(g1, g2)
