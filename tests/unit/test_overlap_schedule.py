"""--rl-desired-lag: the rounds of the two pools (puzzle/dataflow/overlap_stage.py), a resumed
run's rounds, the batches in flight through a checkpoint's JSON, which lag takes them, and the
flags' refusals at start."""

import json

import pytest
import torch

from puzzle.arguments import parse_args, validate_args
from puzzle.config_flags import ArgumentError
from puzzle.checkpointing import in_flight_problem
from puzzle.dataflow.batch import RolloutBatch
from puzzle.dataflow.overlap_stage import (GeneratedBatch, InFlight, first_round, generation_version, num_rounds,
                                           round_work)


def rounds(n, lag, start=0, in_flight=0):
    return [round_work(r, n, lag, start) for r in range(first_round(start, in_flight), num_rounds(n, lag) + 1)]


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


@pytest.mark.parametrize("n, lag, k", [(4, 1, 2), (6, 2, 1), (6, 2, 3), (5, 2, 4), (3, 1, 3)])
def test_resumed_with_its_batches_in_flight_the_rounds_are_the_uninterrupted_ones(n, lag, k):
    """Saved after iteration k (round k + lag) holding batches k+1 .. k+lag (those generated):
    the resumed run's rounds are the rest of the uninterrupted run's, the same work each."""
    held = min(lag, n - k)

    def busy(ws):  # (near the end a resumed run first passes rounds with nothing left to do)
        return [w for w in ws if w.generate or w.train]

    assert busy(rounds(n, lag, start=k, in_flight=held)) == busy(rounds(n, lag)[k + lag:])


def test_resumed_without_batches_in_flight_the_pipeline_fills_from_the_checkpoint():
    """A synchronous run's checkpoint at iteration 2 resumed at lag 1: batch 3 and 4 are generated
    with version 2 (the weights at hand), as a fresh run's first two with version 0."""
    got = [(w.generate, w.version, w.train, w.send_weights) for w in rounds(5, 1, start=2)]
    assert got == [(3, 2, None, False), (4, 2, 3, True), (5, 3, 4, False), (None, -1, 5, False)]
    # a lag-2 checkpoint holding one batch (the 3rd) resumed at lag 2 and at lag 3
    assert [(w.generate, w.version, w.train) for w in rounds(5, 2, start=2, in_flight=1)] == [
        (4, 2, None), (5, 2, 3), (None, -1, 4), (None, -1, 5)]
    assert [w.train for w in rounds(5, 3, start=2, in_flight=1)] == [None, None, 3, 4, 5]


def _held(index, version, B=3, R=4, S=9, grouped=True):
    g = torch.Generator().manual_seed(index)
    logprobs = -torch.rand(B, R, generator=g) * 7  # float32 values that print with many digits
    batch = RolloutBatch(torch.randint(0, 250, (B, S), generator=g), torch.tensor([3, 4, 5]), torch.tensor([4, 1, 0]),
                         R, gen_logprobs=logprobs, group_index=torch.tensor([0, 0, 1]) if grouped else None)
    return GeneratedBatch(index, batch, version, 0.25)


def test_batches_in_flight_through_the_checkpoint_json_bitwise():
    held = InFlight(2, torch.device("cpu"))
    held.put(_held(3, 1))
    held.put(_held(4, 2, grouped=False))
    state = json.loads(json.dumps({"overlap": held.state_dict()}))["overlap"]  # as trainer_state.json keeps it
    back = InFlight(2, torch.device("cpu"))
    back.load_state_dict(state)
    assert [(b.index, b.version, b.seconds) for b in back.batches] == [(3, 1, 0.25), (4, 2, 0.25)]
    for a, b in zip(held.batches, back.batches):
        for name in ("tokens", "prompt_lengths", "response_lengths", "gen_logprobs", "group_index"):
            x, y = getattr(a.batch, name), getattr(b.batch, name)
            assert (x is None and y is None) or (torch.equal(x, y) and x.dtype == y.dtype), name
    assert back.take(4) is None and back.take(3).index == 3 and back.take(4).index == 4 and len(back) == 0
    with pytest.raises(RuntimeError):
        back.put(_held(6, 4)) or back.put(_held(8, 5))  # out of order


def test_which_lag_takes_the_batches_in_flight():
    two = {"lag": 2, "batches": [{"index": 5}, {"index": 6}]}
    assert in_flight_problem(two, 2) is None and in_flight_problem(two, 0) is None  # lag 0: trained first
    assert in_flight_problem(two, 3) is None  # a longer lag fills its pipeline behind them
    assert in_flight_problem({"lag": 2, "batches": []}, 1) is None and in_flight_problem(None, 1) is None
    problem = in_flight_problem(two, 1)
    assert "--rl-desired-lag 2" in problem and "--rl-desired-lag 1" in problem and "5..6" in problem
    with pytest.raises(ValueError, match="--rl-desired-lag 1"):
        InFlight(1, torch.device("cpu")).load_state_dict(two)


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
    (LAG + POOL + ["--actor-gen-pipeline-model-parallel-size", "2"], "--rl-desired-lag", "P=1"),
])
def test_bad_overlap_flags_refused_at_start(extra, flag, text):
    with pytest.raises(ArgumentError) as e:
        cfg(*extra)
    named, _, message = str(e.value).partition(": ")
    assert flag in named.split("/") and text in message, str(e.value)


def test_a_batch_in_flight_becomes_the_rollout_of_its_iteration():
    """Its tokens' version and staleness, padded to the run's sequence multiple (a checkpoint's
    batch resumed where sequence parallelism splits the sequence over another T)."""
    from types import SimpleNamespace

    from puzzle.dataflow.trainer import PPOTrainer

    held = _held(5, 3)  # batch 5 sampled under version 3: one version behind
    fake = SimpleNamespace(seq_multiple=4, tokenizer=SimpleNamespace(pad_id=258, eos_id=257))
    rollout = PPOTrainer._generated_rollout(fake, held, [{}, {}])
    assert rollout.batch.tokens.shape == (3, 12) and torch.equal(rollout.batch.tokens[:, :9], held.batch.tokens)
    assert (rollout.batch.tokens[:, 9:] == 258).all()
    assert rollout.versions.tolist() == [[3, 3, 3, 3], [3, -1, -1, -1], [-1, -1, -1, -1]]
    assert rollout.stats["generation_policy_version"] == 3 and rollout.stats["partial_token_lag_max"] == 1.0
