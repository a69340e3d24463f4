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


def stage():
    cfg = SimpleNamespace(seed=1, ppo=SimpleNamespace(n_samples_per_prompt=N, rl_partial_rollouts_oversample=2.0,
                                                      max_new_tokens=R))
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
    (PARTIAL + ["--env", "calculator", "--max-turns", "2"], "--rl-partial-rollouts", "--max-turns"),
])
def test_bad_partial_flags_refused_at_start(extra, flag, text):
    with pytest.raises(ArgumentError) as e:
        cfg(*extra)
    assert str(e.value).startswith(flag) and text in str(e.value)


def test_partial_generation_layouts():
    assert cfg(*PARTIAL).ppo.rl_partial_rollouts
    with pytest.raises(ArgumentError, match="--rl-partial-rollouts: the actor generates in 2 data-parallel"):
        cfg(*PARTIAL, world=2)
    with pytest.raises(ArgumentError, match="--rl-partial-rollouts: needs an actor generation layout with P=1"):
        cfg(*PARTIAL, "--pipeline-model-parallel-size", "2", world=2)
    assert cfg(*PARTIAL, "--actor-gen-tensor-model-parallel-size", "2", world=2).ppo.rl_partial_rollouts


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
