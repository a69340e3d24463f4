"""Partial rollouts (puzzle/rollout/partial.py): the group quota, generate's resume arguments,
the buffer between iterations and its staleness metrics, without a model."""

import random

import pytest
import torch

from puzzle.rollout.partial import (EpisodeState, GroupQuota, PartialRolloutBuffer, PartialSample, check_resume,
                                    check_sample_ids, stale_token_mask, staleness)
from puzzle.rollout.sampling import SamplingParams


def _sample(prompt, index, started=0, tokens=(), versions=None, finished=False):
    tokens = torch.tensor(list(tokens), dtype=torch.long)
    versions = torch.full((len(tokens),), started, dtype=torch.long) if versions is None \
        else torch.tensor(versions, dtype=torch.long)
    return PartialSample(prompt, index, sample_id=10 * prompt + index, seed=7, started=started,
                         tokens=tokens, logprobs=-tokens.float() / 10, versions=versions, finished=finished)


def test_quota_counts_whole_groups():
    q = GroupQuota.consecutive(6, 2, 2)
    assert q.group_of == (0, 0, 1, 1, 2, 2)
    t = q.tracker()
    assert not t.add([0, 2, 4])  # one row of every group: no group complete
    assert not t.add([3])        # group 1 complete
    assert t.add([1])            # group 0 complete: 2 groups
    with pytest.raises(RuntimeError, match="row 1 finished twice"):
        t.add([1])
    # groups of uneven size (a carried group with one row still generating)
    t = GroupQuota((5, 9, 9), 1).tracker()
    assert t.add([0])


def test_quota_arguments_checked():
    with pytest.raises(ValueError, match="dividing the 5 rows"):
        GroupQuota.consecutive(5, 2, 1)
    with pytest.raises(ValueError, match="3 entries for 4 rows"):
        GroupQuota((0, 0, 1), 1).check(4)
    with pytest.raises(ValueError, match=r"in \[1, 2\]"):
        GroupQuota((0, 0, 1, 1), 3).check(4)
    GroupQuota((0, 0, 1, 1), 2).check(4)


def test_resume_arguments_checked():
    p = SamplingParams(4, eos_id=9)
    assert check_resume(2, p, 100, None, None) is None
    tok, lp = check_resume(2, p, 100, [[1, 2], []], [torch.tensor([-0.5, -0.25]), []])
    assert tok == [[1, 2], []] and lp[0].dtype == torch.float32 and lp[0].tolist() == [-0.5, -0.25]
    for args, msg in [(([[1]], None), "go together"),
                      (([[1]], [[0.0]]), "one entry per prompt"),
                      (([[1], [1, 2, 3, 4]], [[0.0], [0.0] * 4]), "leaves nothing of max_new_tokens=4"),
                      (([[1], [9]], [[0.0], [0.0]]), "holds a stop id"),
                      (([[1], [100]], [[0.0], [0.0]]), r"outside \[0, 100\)"),
                      (([[1], [2]], [[0.0], []]), "1 partial tokens but 0 log-probs"),
                      (([[1], [2]], [[0.0], [float("nan")]]), "finite")]:
        with pytest.raises(ValueError, match=msg):
            check_resume(2, p, 100, *args)
    assert check_sample_ids(3, 5, None) == [5, 6, 7]
    assert check_sample_ids(2, 0, [8, 3]) == [8, 3]
    with pytest.raises(ValueError, match="distinct"):
        check_sample_ids(2, 0, [3, 3])
    with pytest.raises(ValueError, match="one per prompt"):
        check_sample_ids(2, 0, [3])


def test_generation_output_marks_unfinished_rows():
    """A row finished iff it ends with a stop id or holds max_new_tokens tokens."""
    from puzzle.rollout.generation import Results, _assemble

    out = torch.tensor([[7, 8, 9, 5], [4, 2, 6, 6], [4, 6, 1, 1], [0, 0, 0, 0]])
    res = Results(out, torch.tensor([4, 2, 3, 0]), torch.zeros(4, 4))
    o = _assemble([[1]] * 4, res, SamplingParams(4, eos_id=2, eos_ids=(1,)), forward_passes=1)
    assert o.finished.tolist() == [True, True, True, False]
    res = Results(out, torch.tensor([3, 2, 2, 1]), torch.zeros(4, 4))
    assert _assemble([[1]] * 4, res, SamplingParams(4, eos_id=2), 1).finished.tolist() == [False, True, False, False]


def test_take_order_oldest_first_then_prompt_whole_groups():
    buf = PartialRolloutBuffer()
    buf.put([_sample(4, 1, started=2, tokens=[1]), _sample(4, 0, started=3, tokens=[2], finished=True),
             _sample(1, 0, started=3, tokens=[3]), _sample(7, 0, started=2, tokens=[]),
             _sample(0, 1, started=5, tokens=[5, 6])])
    assert buf.group_order() == [4, 7, 1, 0]
    first = buf.take(max_groups=1)
    assert [s.key for s in first] == [(4, 0), (4, 1)]  # the whole group, by sample index
    assert [s.key for s in buf.take(2)] == [(7, 0), (1, 0)]
    assert len(buf) == 1 and [s.key for s in buf.take()] == [(0, 1)] and len(buf) == 0
    assert buf.take() == []


def test_put_refuses_duplicates_and_ragged_samples():
    buf = PartialRolloutBuffer()
    buf.put([_sample(1, 0, tokens=[1])])
    with pytest.raises(ValueError, match=r"already in the buffer.*\(1, 0\)"):
        buf.put([_sample(1, 0, tokens=[2])])
    with pytest.raises(ValueError, match=r"\(2, 0\)"):
        buf.put([_sample(2, 0), _sample(2, 0)])
    with pytest.raises(ValueError, match="differ in length"):
        buf.put([_sample(3, 0, tokens=[1, 2], versions=[0])])
    assert len(buf) == 1


def test_extended_keeps_old_tokens_and_versions():
    s = _sample(3, 1, started=2, tokens=[5, 6])
    new = s.extended(torch.tensor([5, 6, 7, 8]), torch.tensor([-0.5, -0.6, -0.7, -0.8]), version=4, finished=True)
    assert new.tokens.tolist() == [5, 6, 7, 8] and new.versions.tolist() == [2, 2, 4, 4]
    assert new.finished and new.started == 2 and new.sample_id == s.sample_id
    with pytest.raises(ValueError, match="does not continue"):
        s.extended(torch.tensor([5, 9, 7]), torch.zeros(3), version=4, finished=False)


def test_state_dict_round_trip():
    buf = PartialRolloutBuffer()
    buf.put([_sample(2, 0, started=1, tokens=[4, 5], versions=[1, 2]), _sample(2, 1, started=1),
             _sample(0, 0, started=2, tokens=[9], finished=True)])
    state = buf.state_dict()
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    assert state["lengths"].tolist() == [1, 2, 0] and state["tokens"].tolist() == [9, 4, 5]
    other = PartialRolloutBuffer()
    other.load_state_dict(state)
    a, b = buf.take(), other.take()
    assert [s.key for s in a] == [s.key for s in b] == [(2, 0), (2, 1), (0, 0)]
    for x, y in zip(a, b):
        assert (x.sample_id, x.seed, x.started, x.finished) == (y.sample_id, y.seed, y.started, y.finished)
        for f in ("tokens", "logprobs", "versions"):
            assert torch.equal(getattr(x, f), getattr(y, f)) and getattr(x, f).dtype == getattr(y, f).dtype
    empty = PartialRolloutBuffer()
    empty.load_state_dict(PartialRolloutBuffer().state_dict())
    assert len(empty) == 0
    state["lengths"] = torch.tensor([1, 2, 1])
    with pytest.raises(ValueError, match="do not add up"):
        empty.load_state_dict(state)


def test_staleness_metrics():
    m = staleness([torch.tensor([3, 3, 5]), torch.tensor([5, 5]), torch.tensor([4])], version=5)
    assert m["partial_token_lag_mean"] == pytest.approx(5 / 6)  # lags 2 2 0 0 0 1
    assert m["partial_token_lag_max"] == 2.0
    assert m["partial_carried_fraction"] == pytest.approx(2 / 3)
    assert m["partial_stale_masked_frac"] == 0.0  # no bound: nothing masked
    assert staleness([], 3) == {"partial_token_lag_mean": 0.0, "partial_token_lag_max": 0.0,
                                "partial_carried_fraction": 0.0, "partial_stale_masked_frac": 0.0}
    with pytest.raises(ValueError, match="newer"):
        staleness([torch.tensor([6])], version=5)
    lagged = [torch.tensor([3, 3, 5]), torch.tensor([5, 5]), torch.tensor([4])]
    assert staleness(lagged, 5, max_staleness=1)["partial_stale_masked_frac"] == pytest.approx(2 / 6)
    assert staleness(lagged, 5, max_staleness=0)["partial_stale_masked_frac"] == pytest.approx(3 / 6)
    assert staleness(lagged, 5, max_staleness=2)["partial_stale_masked_frac"] == 0.0


def test_stale_token_mask_bounds_the_lag_in_versions():
    versions = torch.tensor([[3, 3, 4, 5, -1], [5, 5, -1, -1, -1], [0, 2, 4, 5, 5]])
    # version 5: K = 1 keeps the tokens of versions 4 and 5, K = 0 only version 5's (slime's mask)
    assert stale_token_mask(versions, 5, 1).tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 1, 1, 1]]
    assert stale_token_mask(versions, 5, 0).tolist() == [[0, 0, 0, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 1, 1]]
    assert stale_token_mask(versions, 5, 5).tolist() == [[1] * 5] * 3  # every lag <= 5
    assert stale_token_mask(versions, 5, 1).dtype == torch.float32
    for bad, text in ((-1, ">= 0"), (1.0, "an int")):
        with pytest.raises(ValueError, match=text):
            stale_token_mask(versions, 5, bad)
    with pytest.raises(ValueError, match="newer"):
        stale_token_mask(versions, 4, 1)
    with pytest.raises(ValueError, match=r"\[B, R\]"):
        stale_token_mask(versions[0], 5, 1)


def _true_token(prompt, index, step):
    """The token sample (prompt, index) samples at ``step`` (its whole response is fixed)."""
    return (prompt * 31 + index * 7 + step * 3) % 50


def _simulate(seed, iterations=8, group_size=3, groups_per_batch=2, serve=4, max_new=6):
    """Iterations of a stage that serves ``serve`` groups (carried ones first, then fresh
    prompts), generates a random number of tokens per sample and stops at the batch's quota of
    whole groups; returns (trained samples in order, the buffer, prompts served so far)."""
    rng = random.Random(seed)
    buf, trained, next_prompt = PartialRolloutBuffer(), [], 0
    for version in range(iterations):
        carried = buf.take(max_groups=serve)
        groups = {}
        for s in carried:
            groups.setdefault(s.prompt_index, []).append(s)
        while len(groups) < serve:
            groups[next_prompt] = [_sample(next_prompt, i, started=version) for i in range(group_size)]
            next_prompt += 1
        # the generation: every unfinished sample advances by a random number of tokens (its
        # true tokens), finishing at max_new or by chance; the quota then picks the first
        # complete groups in service order, the rest is carried over
        done, back = [], []
        for prompt, samples in groups.items():
            new = []
            for s in samples:
                if not s.finished:
                    n = min(max_new, len(s.tokens) + rng.randint(0, 3))
                    toks = torch.tensor([_true_token(prompt, s.sample_index, t) for t in range(n)])
                    s = s.extended(toks, -toks.float() / 10, version, n == max_new or rng.random() < 0.3)
                new.append(s)
            (done if all(s.finished for s in new) and len(done) < groups_per_batch * group_size
             else back).extend(new)
        buf.put(back)
        trained.extend(done)
    return trained, buf, next_prompt


@pytest.mark.parametrize("seed", range(5))
def test_nothing_lost_or_duplicated_over_iterations(seed):
    trained, buf, prompts = _simulate(seed)
    keys = [s.key for s in trained]
    assert len(keys) == len(set(keys))  # trained at most once
    left = {s.key for s in buf.take()}
    assert not left & set(keys)
    assert set(keys) | left == {(p, i) for p in range(prompts) for i in range(3)}  # nothing lost
    for s in trained:
        assert s.finished
        assert s.tokens.tolist() == [_true_token(s.prompt_index, s.sample_index, t) for t in range(len(s.tokens))]
        assert torch.equal(s.logprobs, -s.tokens.float() / 10)
        v = s.versions.tolist()
        assert v == sorted(v) and (not v or v[0] >= s.started)
    assert len(trained) > 0
    assert any(len(set(s.versions.tolist())) > 1 for s in trained)  # resumed under a newer version
    # deterministic: the same pattern gives the same order and contents
    again, _, _ = _simulate(seed)
    assert [(s.key, s.tokens.tolist(), s.versions.tolist()) for s in again] == \
        [(s.key, s.tokens.tolist(), s.versions.tolist()) for s in trained]


def _episode_sample(prompt, index, tokens, observation, spans, reward=None, env=None):
    s = _sample(prompt, index, tokens=tokens)
    return PartialSample(**{**s.__dict__, "episode": EpisodeState(torch.tensor(observation, dtype=torch.bool), spans,
                                                                  len(tokens), reward, [(e - 1, 0.5) for _, e in spans[:1]], "why",
                                                                  env)})


def test_resume_allows_stop_ids_in_observations_only():
    p = SamplingParams(6, eos_id=9)
    check_resume(1, p, 100, [[1, 9, 2]], [[0.0] * 3], observation=[[False, True, False]])  # Qwen's <|im_end|>
    with pytest.raises(ValueError, match="holds a stop id"):
        check_resume(1, p, 100, [[1, 9, 2]], [[0.0] * 3], observation=[[True, False, False]])
    with pytest.raises(ValueError, match="observation mask of 2"):
        check_resume(1, p, 100, [[1, 9, 2]], [[0.0] * 3], observation=[[True, False]])


def test_episodes_are_carried_and_checkpointed_without_their_instance():
    env = object()
    a = _episode_sample(3, 0, [4, 5, 6, 7], [False, True, True, False], [(0, 1)], reward=0.5, env=env)
    b = _episode_sample(1, 1, [8], [False], [], env=None)
    grown = a.extended(torch.tensor([4, 5, 6, 7, 2]), torch.zeros(5), version=3, finished=False,
                       episode=EpisodeState(torch.tensor([False, True, True, False, False]), [(0, 1)], 3))
    assert grown.versions.tolist() == [0, 0, 0, 0, 3] and grown.episode.turn_start == 3
    with pytest.raises(ValueError, match="observation mask does not continue"):
        a.extended(torch.tensor([4, 5, 6, 7]), torch.zeros(4), 3, False, EpisodeState(torch.tensor([False] * 4)))
    buf = PartialRolloutBuffer()
    buf.put([a, b])
    state = buf.state_dict()
    assert state["observation"].tolist() == [False, False, True, True, False]  # (1, 1) first, then (3, 0)
    assert state["episodes"][1] == {"spans": [[0, 1]], "turn_start": 4, "reward": 0.5, "turn_rewards": [[0, 0.5]],
                                    "last_error": "why"}
    loaded = PartialRolloutBuffer()
    loaded.load_state_dict(state)
    x, y = {s.key: s for s in loaded.take()}[(3, 0)], a
    assert torch.equal(x.episode.observation, y.episode.observation) and x.episode.spans == y.episode.spans
    assert (x.episode.reward, x.episode.turn_rewards, x.episode.last_error, x.episode.turn_start) == (0.5, [(0, 0.5)], "why", 4)
    assert x.episode.env is None and x.episode.restored  # its instance is rebuilt by replaying its turn
    assert not EpisodeState.from_plain(EpisodeState.fresh().plain(), torch.zeros(0)).restored  # nothing to replay
    buf.put([_sample(5, 0, tokens=[1])])
    with pytest.raises(ValueError, match="mixed"):
        buf.state_dict()
    with pytest.raises(ValueError, match="observation mask and tokens differ"):
        PartialRolloutBuffer().put([_episode_sample(6, 0, [1, 2], [False], [(0, 1)])])
