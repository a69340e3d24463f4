"""--rl-partial-rollouts: the generation stage's buffer wiring (puzzle/dataflow/partial_stage.py)
with a stand-in generator, and the flags refused at start."""

import json
from types import SimpleNamespace

import pytest
import torch

from puzzle.arguments import ArgumentError, parse_args, validate_args
from puzzle.dataflow.partial_stage import PartialRollouts

N, G, R = 2, 3, 6


def length_of(sample_id):  # a long tail: every fourth sample runs to the budget
    return R if sample_id % 4 == 3 else 1 + sample_id % 3


def token_of(sample_id, pos):  # what an uninterrupted run samples at pos
    return 10 + (7 * sample_id + pos) % 50


class FakeGenerator:
    """One token per row per step, all rows at once; stops at the quota; log-prob of a token:
    -(call index + pos / 100), so each token says which call sampled it."""

    def __init__(self):
        self.calls = 0

    def __call__(self, engine, rows, partial_tokens, partial_logprobs, sample_ids, stop):
        self.calls += 1
        b = len(rows)
        toks = [list(t) for t in partial_tokens]
        lps = [list(map(float, lp)) for lp in partial_logprobs]
        for r, sid in enumerate(sample_ids):
            assert toks[r] == [token_of(sid, i) for i in range(len(toks[r]))]  # resumed where it stopped
        tracker, done = stop.tracker(), [False] * b
        met = False
        while not met and not all(done):
            newly = []
            for r, sid in enumerate(sample_ids):
                if not done[r]:
                    toks[r].append(token_of(sid, len(toks[r])))
                    lps[r].append(-(self.calls + len(toks[r]) / 100))
                    if len(toks[r]) >= length_of(sid):
                        done[r] = True
                        newly.append(r)
            met = tracker.add(newly)
        resp = torch.zeros(b, R, dtype=torch.long)
        lp = torch.zeros(b, R)
        for r in range(b):
            resp[r, :len(toks[r])] = torch.tensor(toks[r])
            lp[r, :len(lps[r])] = torch.tensor(lps[r])
        return resp, torch.tensor([len(t) for t in toks]), lp, torch.tensor(done)


def stage(max_staleness=None):
    ppo = SimpleNamespace(n_samples_per_prompt=N, rl_partial_rollouts_oversample=2.0, max_new_tokens=R,
                          rl_partial_rollouts_max_staleness=max_staleness)
    cfg = SimpleNamespace(seed=1, ppo=ppo)
    return PartialRollouts(cfg, SimpleNamespace(pad_id=0), torch.device("cpu"))


def prompts_from(start):
    """The loader: batches of G prompts, prompt k's ids [k + 1, k + 2]; records {"k": k}."""
    state = {"next": start}

    def draw():
        k0 = state["next"]
        state["next"] += G
        return [[k + 1, k + 2] for k in range(k0, k0 + G)], [{"k": k} for k in range(k0, k0 + G)]
    return draw


def run(st, gen, draw, iterations, first=1):
    out = []
    for it in range(first, first + iterations):
        batch, records, versions, ids, stats = st.run(None, gen, *draw(), draw, it)
        out.append((batch, records, versions, ids, stats))
    return out


def test_whole_groups_carried_resumed_nothing_lost_or_duplicated():
    st, gen = stage(), FakeGenerator()
    trained = []
    for it, (batch, records, versions, ids, stats) in enumerate(run(st, gen, prompts_from(0), 6), start=1):
        assert batch.size == G * N and len(records) == G
        assert batch.group_index.tolist() == [b // N for b in range(G * N)]
        for b, sid in enumerate(ids):
            p, j = divmod(sid, N)
            assert records[b // N] == {"k": p} and b % N == j  # prompt-major, by sample index
            n = int(batch.response_lengths[b])
            assert n == length_of(sid)
            assert batch.tokens[b, :2].tolist() == [p + 1, p + 2]
            assert batch.tokens[b, 2:2 + n].tolist() == [token_of(sid, i) for i in range(n)]
            v, lp = versions[b, :n], batch.gen_logprobs[b, :n]
            # each token's behaviour log-prob is the one of the call (= version + 1) that sampled it
            want = torch.tensor([-(float(v[i]) + 1 + (i + 1) / 100) for i in range(n)])
            assert torch.equal(lp, want.float()) and int(v.max()) <= it - 1
            assert (versions[b, n:] == -1).all()
        trained += ids
        assert stats["partial_groups_served"] == 2 * G
    assert len(trained) == len(set(trained))  # never trained twice
    held = {s.sample_id for s in st.buffer.take()}
    assert not held & set(trained)
    served = set(trained) | held | {p * N + j for p in st.pending for j in range(N)}
    assert served == set(range(st.drawn * N))  # every drawn sample is trained, held or pending


def test_staleness_metrics_and_carried_samples():
    st, gen = stage(), FakeGenerator()
    rows = run(st, gen, prompts_from(0), 4)
    lags = [r[4]["partial_token_lag_max"] for r in rows]
    assert lags[0] == 0 and max(lags) >= 1  # the long samples come back later, sampled by older weights
    assert max(r[4]["partial_carried_fraction"] for r in rows) > 0
    assert all(r[4]["partial_stale_masked_frac"] == 0.0 and r[0].policy_loss_mask is None for r in rows)


@pytest.mark.parametrize("K", [0, 1])
def test_max_staleness_masks_the_old_tokens_of_the_batch(K):
    """--rl-partial-rollouts-max-staleness: the batch's policy_loss_mask is 0 exactly at the tokens
    sampled more than K versions before the batch's; the rows, tokens and versions are the same as
    without it. The stand-in's carried tokens lag by 1 version: K = 0 masks them, K = 1 trains them."""
    plain, bounded = (run(stage(k), FakeGenerator(), prompts_from(0), 5) for k in (None, K))
    masked = 0
    for it, (b0, _, v0, i0, s0), (b, _, v, i, s) in zip(range(1, 6), plain, bounded):
        assert torch.equal(b0.tokens, b.tokens) and torch.equal(v0, v) and i0 == i
        n = b.response_lengths.unsqueeze(1)
        inside = torch.arange(R).unsqueeze(0) < n
        stale = inside & (v < it - 1 - K)
        assert torch.equal(b.policy_loss_mask, (~stale).float())
        assert s["partial_stale_masked_frac"] == pytest.approx(int(stale.sum()) / int(n.sum()))
        assert s0["partial_stale_masked_frac"] == 0.0
        masked += int(stale.sum())
    assert (masked > 0) == (K == 0)


def test_state_dict_resumes_as_uninterrupted():
    straight_st, gen = stage(), FakeGenerator()
    draw = prompts_from(0)
    straight = run(straight_st, gen, draw, 5)
    st, gen2 = stage(), FakeGenerator()
    draw2 = prompts_from(0)
    run(st, gen2, draw2, 2)
    state = json.loads(json.dumps(st.state_dict()))  # as trainer_state.json holds it
    resumed_st = stage()
    resumed_st.load_state_dict(state)
    resumed = run(resumed_st, gen2, draw2, 3, first=3)
    for (b1, r1, v1, i1, s1), (b2, r2, v2, i2, s2) in zip(straight[2:], resumed):
        assert torch.equal(b1.tokens, b2.tokens) and torch.equal(b1.gen_logprobs, b2.gen_logprobs)
        assert torch.equal(v1, v2) and i1 == i2 and r1 == r2 and s1 == s2


BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--micro-batch-size", "2", "--rollout-batch-size", "8", "--max-new-tokens", "16",
        "--reward-fn", "puzzle.reward_functions.builtin:exact_match",
        "--advantage-estimator", "grpo", "--n-samples-per-prompt", "4"]
PARTIAL = ["--rl-partial-rollouts", "--rl-inference-logprobs-is-correction"]


def cfg(*extra, world=1):
    return validate_args(parse_args(BASE + list(extra)), world, 259)


@pytest.mark.parametrize("extra, flag, text", [
    (["--rl-partial-rollouts-oversample", "0.5"], "--rl-partial-rollouts-oversample", ">= 1"),
    (PARTIAL + ["--rl-partial-rollouts-oversample", "0.5"], "--rl-partial-rollouts-oversample", ">= 1"),
    (["--rl-partial-rollouts-oversample", "3"], "--rl-partial-rollouts-oversample", "needs --rl-partial-rollouts"),
    (["--rl-partial-rollouts"], "--rl-partial-rollouts", "--rl-inference-logprobs-is-correction"),
    (PARTIAL + ["--advantage-estimator", "remax"], "--rl-partial-rollouts", "remax"),
    (PARTIAL + ["--filter-groups"], "--rl-partial-rollouts", "--filter-groups"),
    (PARTIAL + ["--rl-partial-rollouts-max-staleness", "-1"], "--rl-partial-rollouts-max-staleness", ">= 0"),
    (["--rl-partial-rollouts-max-staleness", "1"], "--rl-partial-rollouts-max-staleness",
     "needs --rl-partial-rollouts"),
])
def test_bad_partial_flags_refused_at_start(extra, flag, text):
    with pytest.raises(ArgumentError) as e:
        cfg(*extra)
    assert str(e.value).startswith(flag) and text in str(e.value)


def test_partial_generation_layouts():
    assert cfg(*PARTIAL).ppo.rl_partial_rollouts
    assert cfg(*PARTIAL).ppo.rl_partial_rollouts_max_staleness is None
    assert cfg(*PARTIAL, "--rl-partial-rollouts-max-staleness", "0").ppo.rl_partial_rollouts_max_staleness == 0
    with pytest.raises(ArgumentError, match="--rl-partial-rollouts: the actor generates in 2 data-parallel"):
        cfg(*PARTIAL, world=2)
    with pytest.raises(ArgumentError, match="--rl-partial-rollouts: needs an actor generation layout with P=1"):
        cfg(*PARTIAL, "--pipeline-model-parallel-size", "2", world=2)
    assert cfg(*PARTIAL, "--actor-gen-tensor-model-parallel-size", "2", world=2).ppo.rl_partial_rollouts


def test_multi_turn_partial_rollouts_run_in_one_generating_share():
    env = ["--env", "calculator", "--max-turns", "2"]
    assert cfg(*PARTIAL, *env).ppo.rl_partial_rollouts
    # T = 2, D = 1: the TP group's first rank steps the episodes and holds their instances
    assert cfg(*PARTIAL, *env, "--actor-gen-tensor-model-parallel-size", "2", world=2).max_turns == 2
    with pytest.raises(ArgumentError, match="--rl-partial-rollouts: the actor generates in 2 data-parallel"):
        cfg(*PARTIAL, *env, world=2)


def test_train_state_keeps_the_buffer_and_refuses_to_drop_it():
    from puzzle.dataflow.trainer import TrainState

    class Stub:
        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    def train_state(partial):
        return TrainState({}, SimpleNamespace(kl_ctl=Stub()), Stub(),
                          SimpleNamespace(nonfinite=SimpleNamespace(skipped=0)), None, partial)

    st = stage()
    run(st, FakeGenerator(), prompts_from(0), 2)
    state = json.loads(json.dumps(train_state(st).state_dict()))
    assert state["partial_rollouts"]["buffer"]["lengths"]  # samples carried
    again = stage()
    train_state(again).load_state_dict(state)
    assert again.state_dict() == st.state_dict()
    with pytest.raises(ValueError, match="carries .* samples of --rl-partial-rollouts"):
        train_state(None).load_state_dict(state)
    with pytest.raises(ValueError, match="no partial rollouts state"):
        train_state(stage()).load_state_dict({k: v for k, v in state.items() if k != "partial_rollouts"})


# ---- multi-turn samples -------------------------------------------------------------------------
OBS = (2, 3)  # a sample longer than 4 tokens: its turn [0, 2) is answered by 2 observation tokens


def episode_of(sample_id):
    """(the whole response's observation columns, the turns' spans, the rewards (column, value))."""
    n = length_of(sample_id)
    if n <= 4:
        return [], [(0, n)], [(n - 1, 1.0)]
    return list(OBS), [(0, 2), (4, n)], [(1, 0.25), (n - 1, 1.0)]


class FakeTurnGenerator(FakeGenerator):
    """FakeGenerator's samples as episodes: a long one's 3rd and 4th tokens are an observation
    (log-prob 0) after its first turn (reward 0.25), its end a last turn (reward 1.0). The episode's
    instance counts its steps; a restored one (a checkpoint) is rebuilt as a replay would."""

    def __call__(self, engine, rows, partial_tokens, partial_logprobs, sample_ids, stop, records=None, episodes=None):
        from puzzle.dataflow.partial_stage import TurnOutcome
        from puzzle.rollout.partial import EpisodeState

        assert records is not None and len(episodes) == len(rows)
        for sid, toks in zip(sample_ids, partial_tokens):
            assert list(toks) == [token_with_observation(sid, i) for i in range(len(toks))]
        plain = [[token_of(sid, i) for i in range(len(t))] for sid, t in zip(sample_ids, partial_tokens)]
        resp, lengths, lps, finished = super().__call__(engine, rows, plain, partial_logprobs, sample_ids, stop)
        states = []
        for r, (sid, e) in enumerate(zip(sample_ids, episodes)):
            n_before, n = len(partial_tokens[r]), int(lengths[r])
            obs, spans, rewards = episode_of(sid)
            assert e.observation.tolist() == [c in obs for c in range(n_before)]  # carried as it was
            env = {"steps": len(e.spans)} if e.restored else (e.env or {"steps": 0})
            assert env["steps"] == len(e.spans)  # the instance the episode left
            for c in obs:
                if c < n:  # the carried ones are as given (log-prob 0 too)
                    resp[r, c], lps[r, c] = 90 + c, 0.0
            done = [sp for sp in spans if sp[1] <= n and (sp[1] < n or bool(finished[r]) or sp[1] in OBS)]
            env = {"steps": len(done)}
            turn_start = max([b + (2 if b == OBS[0] else 0) for _, b in done], default=0)
            states.append(EpisodeState(torch.tensor([c in obs for c in range(n)]), done, min(turn_start, n),
                                       sum(v for c, v in rewards if any(b - 1 == c for _, b in done)) if done else None,
                                       [(c, v) for c, v in rewards if any(b - 1 == c for _, b in done)], None, env))
        return resp, lengths, lps, finished, TurnOutcome(states, {"turns": 1.0, "tool_calls": 1.0}, 0)


def token_with_observation(sample_id, pos):
    return 90 + pos if pos in episode_of(sample_id)[0] else token_of(sample_id, pos)


def turn_stage():
    st = stage()
    st.multi_turn = True
    return st


def test_multi_turn_samples_carry_their_episodes_into_the_batch():
    st, gen, draw = turn_stage(), FakeTurnGenerator(), prompts_from(0)
    carried_observations = 0
    for it in range(1, 7):
        batch, records, versions, ids, stats = st.run(None, gen, *draw(), draw, it)
        episodes = st.episodes
        for b, sid in enumerate(ids):
            n = int(batch.response_lengths[b])
            obs, spans, rewards = episode_of(sid)
            assert batch.tokens[b, 2:2 + n].tolist() == [token_with_observation(sid, i) for i in range(n)]
            assert batch.loss_mask[b].tolist() == [0.0 if c in obs else 1.0 for c in range(R)]  # no loss on observations
            assert float(episodes.scores[b]) == sum(v for _, v in rewards) and not bool(episodes.bad[b])
            assert episodes.turn_rewards[b].tolist() == [sum(v for c, v in rewards if c == k) for k in range(R)]
            assert all(float(batch.gen_logprobs[b, c]) == 0.0 for c in obs)
            carried_observations += bool(obs) and int(versions[b, 0]) < int(versions[b, OBS[-1]])
        # the per-sample metrics are the trained samples' own, over the iterations that generated them
        assert stats["env_turns_per_sample"] == sum(len(episode_of(i)[1]) for i in ids) / (G * N)
        assert stats["env_tool_calls_per_sample"] == sum(bool(episode_of(i)[0]) for i in ids) / (G * N)
        assert stats["env_observation_tokens_per_sample"] == sum(len(episode_of(i)[0]) for i in ids) / (G * N)
        assert stats["env_replay_mismatches"] == 0 and stats["env_step_errors"] == 0
    assert carried_observations > 0  # an episode stopped before its observation came back to take it


def test_multi_turn_state_dict_resumes_as_uninterrupted():
    straight_st = turn_stage()
    straight = run(straight_st, FakeTurnGenerator(), prompts_from(0), 5)
    st, gen, draw = turn_stage(), FakeTurnGenerator(), prompts_from(0)
    run(st, gen, draw, 2)
    state = json.loads(json.dumps(st.state_dict()))
    assert state["buffer"]["episodes"] and "env" not in state["buffer"]["episodes"][0]
    resumed_st = turn_stage()
    resumed_st.load_state_dict(state)
    assert all(s.episode.restored == bool(s.episode.spans) for s in list(resumed_st.buffer._samples.values()))
    for (b1, _, v1, i1, s1), (b2, _, v2, i2, s2) in zip(straight[2:], run(resumed_st, gen, draw, 3, first=3)):
        assert torch.equal(b1.tokens, b2.tokens) and torch.equal(b1.loss_mask, b2.loss_mask)
        assert torch.equal(v1, v2) and i1 == i2 and s1 == s2
    with pytest.raises(ValueError, match="multi-turn samples, this run's single-turn"):
        stage().load_state_dict(state)


def test_replay_rebuilds_restored_instances_and_counts_what_differs():
    from puzzle.dataflow.partial_stage import replay_episodes
    from puzzle.rollout.partial import EpisodeState

    class Turns:  # EpisodeTurns' step: an instance per row, rebuilt by the steps; "9" answers differently
        def __init__(self, prompts, records):
            self.envs, self.calls = [None] * len(prompts), []
            made.append(self)

        def step(self, rows, turns, histories, final):
            self.calls.append((rows, turns, histories, final))
            for r in rows:
                self.envs[r] = (self.envs[r] or 0) + 1
            return [[7, 7] if t != [9] else [8, 8] for t in turns]

    made = []
    tokens = [[1, 2, 7, 7, 3, 7, 7, 4], [9, 7, 7, 5], [6]]
    eps = [EpisodeState(torch.tensor([c in (2, 3, 5, 6) for c in range(8)]), [(0, 2), (4, 5)], 7, restored=True),
           EpisodeState(torch.tensor([False, True, True, False]), [(0, 1)], 3, restored=True),
           EpisodeState(torch.zeros(1, dtype=torch.bool), [], 0, env="kept")]
    out, differ = replay_episodes(Turns, [[1]] * 3, [{}] * 3, tokens, eps)
    assert differ == 1  # row 1's replayed observation [8, 8] is not the recorded [7, 7]
    assert [e.env for e in out] == [2, 1, "kept"] and not any(e.restored for e in out)
    assert made[0].calls == [([0, 1], [[1, 2], [9]], [[], []], [False, False]), ([0], [[3]], [[1, 2, 7, 7]], [False])]
    assert replay_episodes(Turns, [], [], [], [eps[2]]) == ([eps[2]], 0) and len(made) == 1  # nothing restored
