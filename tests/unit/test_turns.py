"""The multi-turn bookkeeping of the decode loop (puzzle/rollout/turns.py) without a model: turn
ends, the pause and the join at a fixed call of the clock, observations in the response, the
limits; the layouts it refuses."""

import re
import threading

import pytest
import torch

from puzzle.parallel.plan import ParallelPlan
from puzzle.rollout.generation import _check_turns
from puzzle.rollout.turns import TurnResume, TurnTracker


class Handler:
    stops, max_turns = [[9], [7, 8]], 2

    def __init__(self, obs=(5, 6), overlap_calls=0):
        self.obs, self.calls, self.overlap_calls = list(obs), [], overlap_calls

    def step(self, rows, turns, histories, final):
        self.calls += list(zip(rows, turns, histories, final))
        return [None if t[0] == 0 else self.obs for t in turns]  # a turn opening with 0: done


def run(tracker, sampled, row=0):
    """Feed one row's sampled tokens, a call each (the clock), pausing and joining as SlotBatch
    does, until it ends; returns its response."""
    clock, tokens = 0, iter(sampled)
    while True:
        tracker.record([row], torch.tensor([next(tokens)]))
        clock += 1
        status = tracker.end_turns([row], [len(tracker.tokens[row]) >= tracker.max_new], clock)[0]
        if status == "end":
            return tracker.tokens[row]
        if status == "pause":
            clock = tracker.next_due()
            (r, obs, goes_on), = tracker.join(clock)
            assert r == row and tracker.tokens[row][len(tracker.tokens[row]) - len(obs):] == obs
            if not goes_on:
                return tracker.tokens[row]


def test_observations_follow_the_turn_that_ended():
    h = Handler()
    tr = TurnTracker(h, rows=1, max_new=12)
    out = run(tr, [1, 7, 8, 2, 9, 4, 4])
    # turn 1 [1, 7, 8] -> obs [5, 6]; turn 2 [2, 9] is the last (max_turns 2): the row ends there
    assert out == [1, 7, 8, 5, 6, 2, 9]
    assert tr.observation_mask[0].tolist() == [False] * 3 + [True] * 2 + [False] * 7
    tr.close()  # the last turn's step is joined (its reward)
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
    tr.close()
    assert h.calls == [(0, [1, 2, 3], [], True)]


def test_a_step_is_joined_k_calls_later_never_earlier():
    h = Handler(overlap_calls=3)
    tr = TurnTracker(h, rows=2, max_new=12)
    tr.record([0, 1], torch.tensor([7, 1]))
    tr.record([0, 1], torch.tensor([8, 9]))  # both turns end after call 2
    assert tr.end_turns([0, 1], [False, False], clock=2) == ["pause", "pause"]
    assert tr.next_due() == 5
    assert [tr.join(c) for c in (2, 3, 4)] == [[], [], []]
    assert h.calls == []  # an in-process handler steps at the join
    assert tr.join(5) == [(0, [5, 6], True), (1, [5, 6], True)]
    assert tr.tokens == [[7, 8, 5, 6], [1, 9, 5, 6]] and tr.turn_start == [4, 4]


class BackgroundHandler(Handler):
    steps_in_background = True

    def __init__(self):
        super().__init__(overlap_calls=2)
        self.started, self.release = threading.Event(), threading.Event()

    def step(self, rows, turns, histories, final):
        self.started.set()
        assert self.release.wait(10)
        return super().step(rows, turns, histories, final)


def test_a_worker_pool_handler_steps_in_the_background_from_the_submission():
    h = BackgroundHandler()
    tr = TurnTracker(h, rows=1, max_new=12)
    tr.record([0], torch.tensor([9]))
    assert tr.end_turns([0], [False], clock=1) == ["pause"]
    assert h.started.wait(10)  # running while the loop goes on (the join is at call 3)
    assert tr.join(2) == []
    h.release.set()
    assert tr.join(3) == [(0, [5, 6], True)]
    tr.close()
    assert tr.executor is None


def test_pipelined_generation_is_refused_naming_the_layout():
    plan = ParallelPlan(2, 1, 1)
    with pytest.raises(ValueError, match=re.escape(f"runs at P=1 without an expert-parallel split for now; "
                                                   f"the actor generates at {plan}")):
        _check_turns(Handler(), plan, None, False)


def test_graphs_are_refused_and_partial_rows_need_their_turn_state_shape():
    for plan in (ParallelPlan(1, 2, 1), ParallelPlan(1, 1, 2)):  # D > 1 and T > 1 run
        _check_turns(Handler(), plan, None, False)
    plan = ParallelPlan(1, 2, 1)
    _check_turns(Handler(), plan, [[1]], False, [None])  # partial rollouts: resumed rows
    _check_turns(None, ParallelPlan(2, 1, 1), None, True)  # no turns: nothing checked
    with pytest.raises(ValueError, match="CUDA graphs"):
        _check_turns(Handler(), plan, None, True)
    with pytest.raises(ValueError, match="needs turns"):
        _check_turns(None, plan, [[1]], False, [None])
    with pytest.raises(ValueError, match="one entry per prompt"):
        _check_turns(Handler(), plan, [[1], [2]], False, [None])


def test_a_row_stopped_with_its_step_in_flight_resumes_as_the_uninterrupted_one():
    """A quota stop right after the turn [1, 7, 8] paused its row (its step due 3 calls later):
    ``flush`` joins the step at once and writes its observation, ``state`` is what a new tracker
    ``resume``s from; fed the same sampled tokens after it, it ends as the row that was never
    stopped (tokens, mask, handler calls, counts)."""
    sampled = [1, 7, 8, 2, 9, 4, 4]
    whole = TurnTracker(Handler(overlap_calls=3), rows=1, max_new=12)
    want = run(whole, sampled)
    whole.close()
    h = Handler(overlap_calls=3)
    first = TurnTracker(h, rows=1, max_new=12)
    for clock, t in enumerate(sampled[:3], start=1):
        first.record([0], torch.tensor([t]))
        status = first.end_turns([0], [False], clock)
    assert status == ["pause"] and first.next_due() == 6 and h.calls == []
    assert first.flush() == [(0, [5, 6], True)] and first.next_due() is None  # joined now, not at call 6
    assert first.tokens[0] == [1, 7, 8, 5, 6] and first.flush() == []
    state = first.state(0)
    assert state == TurnResume((False,) * 3 + (True,) * 2, 1, 5)
    second = TurnTracker(h, rows=1, max_new=12)
    second.resume(0, first.tokens[0], state)
    assert run(second, sampled[3:]) == want
    second.close()
    assert torch.equal(second.observation_mask, whole.observation_mask)
    assert h.calls == [(0, [1, 7, 8], [], False), (0, [2, 9], [1, 7, 8, 5, 6], True)]
    counts = {k: first.counts[k] + second.counts[k] for k in first.counts}
    assert counts == whole.counts == {"turns": 2, "observation_tokens": 2, "turn_limit_cuts": 1,
                                      "token_limit_cuts": 0}
    with pytest.raises(ValueError, match="does not fit its 2 tokens"):
        second.resume(0, [1, 2], state)


def test_a_flushed_observation_that_fills_the_budget_or_ends_the_episode_ends_the_row():
    tr = TurnTracker(Handler(obs=[5] * 10, overlap_calls=4), rows=2, max_new=6)
    for clock, toks in enumerate(([1, 0], [9, 9]), start=1):
        tr.record([0, 1], torch.tensor(toks))
        status = tr.end_turns([0, 1], [False, False], clock)
    assert status == ["pause", "pause"]
    # row 0: 10 observation tokens, room for 4 (counted as the whole run counts it); row 1's episode is done
    assert tr.flush() == [(0, [5, 5, 5, 5], False), (1, [], False)]
    assert tr.counts["token_limit_cuts"] == 1 and tr.counts["observation_tokens"] == 4
    assert tr.flush() == []


def test_an_appended_segment_attends_to_its_rows_cached_keys():
    """A prefill that appends 3 tokens to slot 1 (after its 5 cached ones), packed with a new
    4-token prompt in slot 0: the appended queries see the row's 8 keys causally, the prompt its
    own 4 (SDPA and the batch-invariant attention)."""
    from puzzle.models import batch_invariant
    from puzzle.models.sdpa_attention import StaticKVCache, appended_mask, sdpa_attention

    g, d, heads = 2, 4, 4
    gen = torch.Generator().manual_seed(3)
    qkv = lambda n: (torch.randn(n, 1, heads, d, generator=gen), torch.randn(n, 1, g, d, generator=gen),  # noqa: E731
                     torch.randn(n, 1, g, d, generator=gen))
    cache = StaticKVCache(2, 10)
    q0, k0, v0 = qkv(5)
    cache.prefill([1], [5])
    cache.store(1, q0, k0, v0)
    cache.prefill([1, 0], [3, 4], starts=[5, 0])
    assert cache.pos.tolist() == [5, 6, 7, 0, 1, 2, 3]
    q, k, v = qkv(7)
    cache.store(1, q, k, v)
    kb = cache.buffers[1][0]
    assert torch.equal(kb[1, :, :5], k0[:, 0].transpose(0, 1)) and torch.equal(kb[1, :, 5:8], k[:3, 0].transpose(0, 1))

    def attend(a, b, c):
        return sdpa_attention(a, b, c, None, a.shape[0] > 1, 0.5)

    out = cache.prefill_attention(attend, q, k, v, lambda a, b, c, start: sdpa_attention(
        a, b, c, appended_mask(a.shape[0], start, a.device), False, 0.5))
    row = attend(torch.cat([q0, q[:3]]), torch.cat([k0, k[:3]]), torch.cat([v0, v[:3]]))[5:]
    ref = torch.cat([row, attend(q[3:], k[3:], v[3:])])
    assert out.shape == (7, 1, heads * d) and torch.allclose(out, ref, atol=1e-6)
    invariant = cache.prefill_attention(lambda a, b, c: batch_invariant.causal_attention(a, b, c, 0.5), q, k, v,
                                        lambda a, b, c, start: batch_invariant.causal_attention(a, b, c, 0.5, start))
    assert torch.allclose(invariant, ref, atol=1e-6)
    with pytest.raises(ValueError, match="cannot append"):
        cache.prefill_attention(attend, q, k, v)
