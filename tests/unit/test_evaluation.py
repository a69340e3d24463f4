"""Evaluation's pure parts: pass@k, when it runs, its batches and metrics; the eval flags."""

import itertools

import pytest
import torch

from puzzle.config import EvalConfig
from puzzle.config_flags import ArgumentError
from puzzle.data.arithmetic import make_records
from puzzle.dataflow.evaluation import eval_batches, evaluation_due, pass_at_k, pass_at_k_values, summarize


def _pass_at_k_by_enumeration(n, c, k):
    outcomes = [1] * c + [0] * (n - c)
    draws = list(itertools.combinations(range(n), k))
    return sum(any(outcomes[i] for i in d) for d in draws) / len(draws)


@pytest.mark.parametrize("n,c,k", [(1, 0, 1), (1, 1, 1), (4, 1, 2), (5, 2, 3), (6, 0, 3), (8, 3, 4), (8, 6, 3)])
def test_pass_at_k_is_the_probability_over_every_draw(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(_pass_at_k_by_enumeration(n, c, k), abs=1e-12)


def test_pass_at_k_edges_and_errors():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(10, 0, 10) == 0.0 and pass_at_k(10, 1, 10) == 1.0
    for bad in ((4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)):
        with pytest.raises(ValueError, match="pass@k"):
            pass_at_k(*bad)
    assert pass_at_k_values(1) == [] and pass_at_k_values(2) == [2]
    assert pass_at_k_values(8) == [2, 4, 8] and pass_at_k_values(12) == [2, 4, 8, 12]


def test_evaluation_is_due_at_zero_every_interval_and_at_the_end():
    assert [i for i in range(0, 11) if evaluation_due(i, 4, 10)] == [0, 4, 8, 10]
    assert [i for i in range(0, 11) if evaluation_due(i, None, 10)] == [0, 10]


def test_eval_batches_cover_the_file_or_eval_iters_batches():
    assert eval_batches(10, 4, None) == [range(0, 4), range(4, 8), range(8, 10)]
    assert eval_batches(10, 4, 2) == [range(0, 4), range(4, 8)]
    with pytest.raises(ValueError, match="--eval-iters 3 batches of --rollout-batch-size 4 prompts need 12"):
        eval_batches(10, 4, 3)


def test_summarize_accuracy_and_pass_at_k():
    scores = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.5, 1.0]])
    lengths = torch.tensor([[2, 2, 2, 2], [1, 1, 1, 1], [3, 3, 3, 3]])
    m = summarize(scores, lengths, with_accuracy=True)
    assert m["eval/reward"] == pytest.approx(4.5 / 12) and m["eval/accuracy"] == pytest.approx(4 / 12)
    assert m["eval/pass@4"] == pytest.approx(2 / 3)  # prompts 0 and 2 have a correct sample
    assert m["eval/pass@2"] == pytest.approx((pass_at_k(4, 1, 2) + 0 + pass_at_k(4, 3, 2)) / 3)
    assert m["eval/response_length"] == pytest.approx(2.0) and m["eval/prompts"] == 3
    plain = summarize(scores[:, :1], lengths[:, :1], with_accuracy=False)  # a reward model: no accuracy
    assert set(plain) == {"eval/reward", "eval/response_length", "eval/prompts"}


def test_eval_flags_need_eval_prompts():
    assert EvalConfig(prompts="x.jsonl", interval=5, iters=2, n_samples=4).samples_per_prompt == 4
    assert EvalConfig().samples_per_prompt == 1
    with pytest.raises(ArgumentError, match="--eval-interval: needs --eval-prompts"):
        EvalConfig(interval=5)
    with pytest.raises(ArgumentError, match="--eval-n-samples-per-prompt: must be >= 1"):
        EvalConfig(prompts="x.jsonl", n_samples=0)


def test_bundled_eval_sums_are_held_out_from_the_training_sums():
    train = make_records(2)
    for held_out in (make_records(2, prefix=" "), make_records(3)):
        assert not {r["prompt"] for r in train} & {r["prompt"] for r in held_out}
        assert all(int(r["answer"]) == sum(map(int, r["prompt"][:-1].split("+"))) <= 9 for r in held_out)
    assert len(train) == 55 and len(make_records(3)) == 220


def test_bundled_files_are_the_generators_output():
    import json

    from puzzle.data.arithmetic import EVAL_PATH, PATH

    for path, prefix in ((PATH, ""), (EVAL_PATH, " ")):
        assert [json.loads(x) for x in path.read_text().splitlines()] == make_records(2, prefix=prefix)


def test_eval_iters_zero_turns_evaluation_off():
    """Megatron-LM's meaning: --eval-iters 0 skips evaluation, also where a script gives --eval-prompts."""
    from puzzle.config import EvalConfig

    assert EvalConfig(prompts="p.jsonl").enabled and EvalConfig(prompts="p.jsonl", iters=2).enabled
    assert not EvalConfig(prompts="p.jsonl", iters=0).enabled and not EvalConfig().enabled
    with pytest.raises(ValueError, match="--eval-iters"):
        EvalConfig(prompts="p.jsonl", iters=-1)


def test_fill_rows_are_neither_scored_nor_counted_as_bad():
    """3 eval prompts on a generation layout of D = 4: one fill row makes the batch divisible; a
    reward function that finds every sample bad is asked for 3 rows and reports 3, not 4."""
    import types
    from types import SimpleNamespace

    from puzzle.dataflow.evaluation import Evaluator
    from puzzle.reward_functions.distributed import RolloutRewarder
    from puzzle.dataflow.reward_stage import Rewards

    asked = []

    class AllBad:
        share = staticmethod(RolloutRewarder.share)

        def score(self, make_sample, size, iteration, what):
            asked.append(size)
            return torch.zeros(size), size

    def sample(engine, ids, seed, greedy, first_sample, records=None):  # the generation stage's sampling
        rows = len(ids)
        return SimpleNamespace(size=rows, tokens=torch.ones(rows, 3, dtype=torch.long),
                               prompt_lengths=torch.ones(rows, dtype=torch.long),
                               response_lengths=torch.full((rows,), 2))

    cfg = SimpleNamespace(evaluation=EvalConfig(prompts="held-out.jsonl"), log_dir=None, train_iters=1, seed=1,
                          roles={}, ppo=SimpleNamespace(rollout_batch_size=8, micro_batch_size=1, greedy=False))
    dataset = SimpleNamespace(prompts=[[1], [2], [3]], records=[])
    engine = SimpleNamespace(layout=SimpleNamespace(plan=SimpleNamespace(D=4)))
    tok = SimpleNamespace(decode=lambda ids: "x", eos_id=0)
    generation = SimpleNamespace(engine=lambda: engine, sample=sample)
    function = AllBad()
    rewards = SimpleNamespace(function=function, tokenizer=tok, multi_turn=False)  # the run's Rewards' scoring path
    rewards.function_scores = types.MethodType(Rewards.function_scores, rewards)
    metrics = Evaluator(cfg, tok, dataset, generation, None, rewards, SimpleNamespace(synchronize=lambda: None),
                        rank=0)(0)
    assert asked == [3] and metrics["eval/bad_rewards"] == 3


def test_multi_turn_eval_runs_episodes_and_reports_their_metrics():
    """--env with --max-turns > 1: the eval rows are generated as episodes (the records go to the
    generation stage), scored by them (a bad one counted, the fill row not), and eval/ gets the
    episodes' metrics; the samples log their turns."""
    import types
    from types import SimpleNamespace

    from puzzle.dataflow.env_turns import EpisodeResults
    from puzzle.dataflow.evaluation import Evaluator
    from puzzle.dataflow.reward_stage import Rewards
    from puzzle.reward_functions.distributed import BadRewardPolicy

    asked = []

    def sample(engine, ids, seed, greedy, first_sample, records=None):
        rows = len(ids)
        asked.append((rows, records))
        generation.episodes = EpisodeResults(torch.tensor([1.0, 0.0, 0.5, 1.0][:rows]),
                                             torch.tensor([False, True, False, True][:rows]),
                                             {"turns": 2.0 * rows, "observation_tokens": 3.0 * rows, "turn_limit_cuts": 0,
                                              "token_limit_cuts": 1, "tool_calls": 1.0 * rows,
                                              "observations_truncated": 0, "env_step_errors": 1, "env_step_timeouts": 0})
        return SimpleNamespace(size=rows, tokens=torch.ones(rows, 4, dtype=torch.long),
                               prompt_lengths=torch.ones(rows, dtype=torch.long),
                               response_lengths=torch.full((rows,), 3),
                               loss_mask=torch.tensor([[1.0, 0.0, 1.0]] * rows))

    cfg = SimpleNamespace(evaluation=EvalConfig(prompts="held-out.jsonl"), log_dir=None, train_iters=1, seed=1,
                          roles={}, ppo=SimpleNamespace(rollout_batch_size=8, micro_batch_size=1, greedy=False))
    dataset = SimpleNamespace(prompts=[[1], [2], [3]], records=[{"answer": "a"}, {"answer": "b"}, {"answer": "c"}])
    engine = SimpleNamespace(layout=SimpleNamespace(plan=SimpleNamespace(D=2)))
    tok = SimpleNamespace(decode=lambda ids: "x", eos_id=0)
    generation = SimpleNamespace(engine=lambda: engine, sample=sample, episodes=None)
    rewards = SimpleNamespace(function=object(), tokenizer=tok, multi_turn=True, env="calculator",
                              policy=BadRewardPolicy("default", 0.0))
    rewards.episode_scores = types.MethodType(Rewards.episode_scores, rewards)
    evaluator = Evaluator(cfg, tok, dataset, generation, None, rewards, SimpleNamespace(synchronize=lambda: None), rank=0)
    metrics = evaluator(0)
    assert asked == [(4, [{"answer": "a"}, {"answer": "b"}, {"answer": "c"}, {"answer": "a"}])]  # + 1 fill row
    assert metrics["eval/bad_rewards"] == 1  # row 1; the fill row's bad episode is not counted
    assert metrics["eval/reward"] == 0.5 and metrics["eval/accuracy"] == 1 / 3
    assert metrics["eval/env_turns_per_sample"] == 2.0 and metrics["eval/env_tool_calls_per_sample"] == 1.0
    assert metrics["eval/env_step_errors"] == 1 and metrics["eval/env_token_limit_cuts"] == 1
    from puzzle.dataflow.env_turns import row_turns

    tok.decode = lambda ids: "".join(map(str, ids))
    assert row_turns(sample(None, [[1]], 0, True, 0), 0, tok) == {
        "turns": [{"model": "1"}, {"observation": "1"}, {"model": "1"}], "tool_calls": 1, "observation_tokens": 1}
