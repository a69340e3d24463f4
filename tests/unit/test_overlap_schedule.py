"""--rl-desired-lag: the rounds of the two pools (puzzle/dataflow/overlap_stage.py) and the
flags' refusals at start."""

import pytest

from puzzle.arguments import parse_args, validate_args
from puzzle.config_flags import ArgumentError
from puzzle.dataflow.overlap_stage import generation_version, num_rounds, round_work


def rounds(n, lag):
    return [round_work(r, n, lag) for r in range(1, num_rounds(n, lag) + 1)]


def test_lag_zero_is_the_synchronous_run():
    for w in rounds(5, 0):  # each round generates and trains its own batch, with the last step's weights
        assert w.generate == w.train == w.round and w.version == w.round - 1
        assert w.send_weights == (w.round < 5)


def test_lag_one_generates_the_next_batch_while_training():
    got = [(w.generate, w.version, w.train, w.send_weights) for w in rounds(4, 1)]
    assert got == [(1, 0, None, False), (2, 0, 1, True), (3, 1, 2, True), (4, 2, 3, False), (None, -1, 4, False)]


@pytest.mark.parametrize("n, lag", [(1, 1), (3, 1), (6, 2), (5, 4), (2, 5)])
def test_every_batch_generated_once_trained_once_in_order(n, lag):
    ws = rounds(n, lag)
    assert [w.generate for w in ws if w.generate] == list(range(1, n + 1))
    assert [w.train for w in ws if w.train] == list(range(1, n + 1))
    trained_in = {w.train: w.round for w in ws if w.train}
    sent_after = {w.train: w.round for w in ws if w.send_weights}  # version v leaves after step v
    for w in ws:
        if w.generate:  # generated with the newest version sent before this round, and never ahead
            assert trained_in[w.generate] >= w.round
            sent = [v for v, r in sent_after.items() if r < w.round]
            assert w.version == max(sent, default=0) == generation_version(w.generate, lag)
            assert w.generate - 1 - w.version == min(lag, w.generate - 1)
    # a version is sent only when a later batch is generated with it
    assert set(sent_after) == {generation_version(k, lag) for k in range(1, n + 1)} - {0}


def test_bad_rounds_refused():
    for r, n, lag in ((0, 3, 1), (5, 3, 1), (1, 3, -1)):
        with pytest.raises(ValueError):
            round_work(r, n, lag)


BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--micro-batch-size", "2", "--rollout-batch-size", "8", "--max-new-tokens", "16",
        "--reward-fn", "puzzle.reward_functions.builtin:exact_match",
        "--advantage-estimator", "grpo", "--n-samples-per-prompt", "4"]
LAG = ["--rl-desired-lag", "1", "--rl-inference-logprobs-is-correction"]
POOL = ["--actor-gen-rank-offset", "2"]


def cfg(*extra, world=4):
    return validate_args(parse_args(BASE + list(extra)), world, 259)


def test_pools_from_the_generation_offset():
    c = cfg(*LAG, *POOL)
    actor = c.roles["actor"]
    assert actor.plan.ranks == [0, 1] and actor.gen_plan.ranks == [2, 3] and c.ppo.rl_desired_lag == 1
    assert cfg(*POOL).ppo.rl_desired_lag == 0  # lag 0 on the pools: the synchronous run
    c = cfg(*LAG, *POOL, "--actor-gen-tensor-model-parallel-size", "2")
    assert c.roles["actor"].gen_plan.T == 2 and c.roles["actor"].gen_plan.offset == 2


@pytest.mark.parametrize("extra, flag, text", [
    (["--rl-desired-lag", "-1"], "--rl-desired-lag", ">= 0"),
    (LAG, "--rl-desired-lag", "--actor-gen-rank-offset"),
    (["--rl-desired-lag", "1"] + POOL, "--rl-desired-lag", "--rl-inference-logprobs-is-correction"),
    (LAG + ["--actor-gen-rank-offset", "4"], "--actor-gen-rank-offset", "outside the world"),
    (LAG + POOL + ["--actor-data-parallel-size", "4"], "--actor-gen-rank-offset", "overlaps"),
    (LAG + POOL + ["--actor-data-parallel-size", "1"], "--actor-gen-rank-offset", "equal sizes"),
    (LAG + POOL + ["--rl-partial-rollouts", "--actor-gen-tensor-model-parallel-size", "2"], "--rl-desired-lag",
     "--rl-partial-rollouts"),
    (LAG + POOL + ["--filter-groups"], "--rl-desired-lag", "--filter-groups"),
    (LAG + POOL + ["--advantage-estimator", "remax"], "--rl-desired-lag", "remax"),
    (LAG + POOL + ["--save", "ckpt"], "--rl-desired-lag", "--save"),
    (LAG + POOL + ["--actor-gen-pipeline-model-parallel-size", "2"], "--rl-desired-lag", "P=1"),
])
def test_bad_overlap_flags_refused_at_start(extra, flag, text):
    with pytest.raises(ArgumentError) as e:
        cfg(*extra)
    named, _, message = str(e.value).partition(": ")
    assert flag in named.split("/") and text in message, str(e.value)
