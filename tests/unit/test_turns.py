"""The multi-turn bookkeeping of the decode loop (puzzle/rollout/turns.py) without a model: turn
ends, observation tokens in place of sampled ones, the limits; the layouts it refuses."""

import re

import pytest
import torch

from puzzle.parallel.plan import ParallelPlan
from puzzle.rollout.generation import _check_turns
from puzzle.rollout.turns import TurnResume, TurnTracker


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


def test_graphs_are_refused_and_partial_rows_need_their_turn_state_shape():
    plan = ParallelPlan(1, 2, 1)
    _check_turns(Handler(), plan, None, None, False)
    _check_turns(Handler(), plan, object(), [[1]], False, [None])  # partial rollouts: a quota, resumed rows
    _check_turns(None, ParallelPlan(2, 1, 1), None, None, True)  # no turns: nothing checked
    with pytest.raises(ValueError, match="CUDA graphs"):
        _check_turns(Handler(), plan, None, None, True)
    with pytest.raises(ValueError, match="needs turns"):
        _check_turns(None, plan, None, [[1]], False, [None])
    with pytest.raises(ValueError, match="one entry per prompt"):
        _check_turns(Handler(), plan, None, [[1], [2]], False, [None])


def test_a_stopped_row_resumes_as_the_uninterrupted_one():
    """A row stopped mid-observation: ``flush`` writes the pending observation, ``state`` is what a
    new tracker ``resume``s from; fed the same sampled tokens after it, it ends as the row that
    was never stopped (tokens, mask, handler calls, counts)."""
    sampled = [1, 7, 8, 3, 3, 2, 9, 4, 4, 4, 4, 4]
    whole = TurnTracker(Handler(), rows=1, max_new=12)
    want = run(whole, sampled)
    h = Handler()
    first = TurnTracker(h, rows=1, max_new=12)
    for step, t in enumerate(sampled[:4]):  # the turn [1, 7, 8] ends; one of 2 observation tokens is in
        first.insert([0], [step], torch.tensor([t]), torch.tensor([-1.0]))
        first.end_turns([0], [False])
    obs, ended = first.flush(0)
    assert obs == [6] and not ended and first.tokens[0] == [1, 7, 8, 5, 6]
    state = first.state(0)
    assert state == TurnResume((False,) * 3 + (True,) * 2, 1, 5)
    second = TurnTracker(h, rows=1, max_new=12)
    second.resume(0, first.tokens[0], state)
    for step, t in enumerate(sampled[5:], start=5):
        second.insert([0], [step], torch.tensor([t]), torch.tensor([-1.0]))
        if second.end_turns([0], [step + 1 >= 12])[0]:
            break
    assert second.tokens[0] == want and torch.equal(second.observation_mask, whole.observation_mask)
    assert h.calls == [(0, [1, 7, 8], [], False), (0, [2, 9], [1, 7, 8, 5, 6], True)]
    with pytest.raises(ValueError, match="does not fit its 2 tokens"):
        second.resume(0, [1, 2], state)


def test_a_flushed_observation_that_fills_the_budget_ends_the_row():
    tr = TurnTracker(Handler(obs=[5] * 10), rows=1, max_new=6)
    for step, t in enumerate([1, 9, 1]):
        tr.insert([0], [step], torch.tensor([t]), torch.tensor([-1.0]))
        tr.end_turns([0], [False])
    assert tr.flush(0) == ([5, 5, 5], True) and tr.counts["token_limit_cuts"] == 1  # as the whole run counts it
    assert tr.flush(0) == ([], False)
