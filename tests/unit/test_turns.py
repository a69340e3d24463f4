"""The multi-turn bookkeeping of the decode loop (puzzle/rollout/turns.py) without a model: turn
ends, observation tokens in place of sampled ones, the limits; the layouts it refuses."""

import re

import pytest
import torch

from puzzle.parallel.plan import ParallelPlan
from puzzle.rollout.generation import _check_turns
from puzzle.rollout.turns import TurnTracker


class Handler:
    stops, max_turns = [[9], [7, 8]], 2

    def __init__(self, obs=(5, 6)):
        self.obs, self.calls = list(obs), []

    def step(self, rows, turns, histories, final):
        self.calls += list(zip(rows, turns, histories, final))
        return [None if t[0] == 0 else self.obs for t in turns]  # a turn opening with 0: done


def run(tracker, sampled, rows=(0,)):
    """Feed the sampled tokens of one row, a call each, until it ends; returns its response."""
    for step, t in enumerate(sampled):
        tok, lp = tracker.insert(list(rows), [step], torch.tensor([t]), torch.tensor([-1.0]))
        assert lp.item() == (0.0 if tracker.observation_mask[rows[0], step] else -1.0)
        if tracker.end_turns(list(rows), [step + 1 >= tracker.max_new])[0]:
            return tracker.tokens[rows[0]]
    raise AssertionError("the row did not end")


def test_observations_replace_the_sampled_tokens_after_a_turn_ends():
    h = Handler()
    tr = TurnTracker(h, rows=1, max_new=12)
    out = run(tr, [1, 7, 8, 3, 3, 2, 9, 4, 4, 4, 4, 4])
    # turn 1 [1, 7, 8] -> obs [5, 6]; turn 2 [2, 9] is the last (max_turns 2): the row ends there
    assert out == [1, 7, 8, 5, 6, 2, 9]
    assert tr.observation_mask[0].tolist() == [False] * 3 + [True] * 2 + [False] * 7
    assert h.calls == [(0, [1, 7, 8], [], False), (0, [2, 9], [1, 7, 8, 5, 6], True)]
    assert tr.counts == {"turns": 2, "observation_tokens": 2, "turn_limit_cuts": 1, "token_limit_cuts": 0}


def test_a_done_episode_ends_its_row_and_the_budget_cuts_an_observation():
    tr = TurnTracker(Handler(), rows=1, max_new=8)
    assert run(tr, [0, 9, 1, 1]) == [0, 9]  # the handler's episode is done: no cut
    assert tr.counts["turn_limit_cuts"] == tr.counts["token_limit_cuts"] == 0
    long = TurnTracker(Handler(obs=[5] * 10), rows=1, max_new=6)
    assert run(long, [1, 9, 1, 1, 1, 1]) == [1, 9, 5, 5, 5, 5]  # 10 observation tokens, room for 4
    assert long.counts == {"turns": 1, "observation_tokens": 4, "turn_limit_cuts": 0, "token_limit_cuts": 1}


def test_the_budget_steps_a_last_turn_as_final():
    h = Handler()
    tr = TurnTracker(h, rows=1, max_new=3)
    assert run(tr, [1, 2, 3]) == [1, 2, 3]
    assert h.calls == [(0, [1, 2, 3], [], True)]


@pytest.mark.parametrize("plan", [ParallelPlan(2, 1, 1), ParallelPlan(1, 1, 2)])
def test_other_layouts_are_refused_naming_them(plan):
    with pytest.raises(ValueError, match=re.escape(f"P=1, T=1 for now; the actor generates at {plan}")):
        _check_turns(Handler(), plan, None, None, False)


def test_partial_rollouts_and_graphs_are_refused():
    plan = ParallelPlan(1, 2, 1)
    _check_turns(Handler(), plan, None, None, False)
    _check_turns(None, ParallelPlan(2, 1, 1), None, None, True)  # no turns: nothing checked
    for args, what in (((object(), None, False), "finished-groups quota"), ((None, [[1]], False), "partial rows"),
                       ((None, None, True), "CUDA graphs")):
        with pytest.raises(ValueError, match=what):
            _check_turns(Handler(), plan, *args)
