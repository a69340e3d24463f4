"""The iteration's parts that own their data, on CPU in a world of one: generation's output in
response coordinates, the rollout batch built from it, the one owner of the scores (decode once,
check, shape), the loss sums by name and the NaN/inf skip policy."""

from types import SimpleNamespace

import pytest
import torch

from puzzle.algorithms.dapo import overlong_penalty
from puzzle.data.tokenizers import build_tokenizer
from puzzle.reward_functions import BadRewardError
from puzzle.dataflow.reward_stage import Rewards, RunningMoments
from puzzle.rollout.generation import Results, _assemble
from puzzle.rollout.sampling import SamplingParams
from puzzle.dataflow.batch import rollout_from_generation
from puzzle.engine.nonfinite import NonFiniteError, SkipPolicy
from puzzle.dataflow.training_stage import ACTOR_SUMS, CRITIC_SUMS, SUM_NAMES, NamedSums
from puzzle.parallel.plan import ParallelPlan

LAYOUT = SimpleNamespace(plan=ParallelPlan(), member=True, p=0, t=0, d=0,
                         generation_share=lambda: (0, 1, True))


def _cfg(reward_fn="puzzle.reward_functions.builtin:lowercase_fraction", normalization="running",
         buffer_len=2, n=2, on_bad="default"):
    ppo = SimpleNamespace(n_samples_per_prompt=n, max_new_tokens=4, overlong_buffer_len=buffer_len,
                          overlong_penalty_factor=0.5, reward_normalization=normalization)
    return SimpleNamespace(ppo=ppo, reward_fn=reward_fn, reward_workers=0, reward_timeout=None,
                           on_bad_reward=on_bad, bad_reward_value=-1.0, reward_model="rm" if not reward_fn else None,
                           env=None, max_turns=1, max_observation_tokens=64, env_step_overlap_calls=4)


def test_generation_output_is_in_response_coordinates():
    out = torch.tensor([[7, 8, 9, 5], [4, 6, 6, 6]])
    res = Results(out, torch.tensor([4, 2]), torch.tensor([[-1.0, -2.0, -3.0, -4.0], [-0.5, -0.25, -9.0, -9.0]]))
    o = _assemble([[1, 2], [3]], res, SamplingParams(4, pad_id=0), forward_passes=3)
    assert o.response_tokens.tolist() == [[7, 8, 9, 5], [4, 6, 0, 0]]  # pad after each response
    assert o.logprobs.tolist() == [[-1.0, -2.0, -3.0, -4.0], [-0.5, -0.25, 0.0, 0.0]]
    assert o.prompt_lengths.tolist() == [2, 1] and o.responses() == [[7, 8, 9, 5], [4, 6]]
    batch = rollout_from_generation([[1, 2], [3]], o.response_tokens, o.response_lengths, LAYOUT, 4, 0,
                                    torch.device("cpu"), logprobs=o.logprobs, with_logprobs=True)
    assert batch.tokens.tolist() == [[1, 2, 7, 8, 9, 5], [3, 4, 6, 0, 0, 0]]
    assert torch.equal(batch.fields["gen_logprobs"], o.logprobs)


def _batch(responses, lengths, prompts):
    R = len(responses[0])
    return rollout_from_generation(prompts, torch.tensor(responses), torch.tensor(lengths), LAYOUT, R, 0,
                                   torch.device("cpu"))


def test_rewards_decode_score_and_shape_in_one_place():
    tok = build_tokenizer("ByteLevelTokenizer", None)
    eos = tok.eos_id
    prompts = [[ord("a")] * 2, [ord("a")] * 2, [ord("b")], [ord("b")]]
    batch = _batch([[ord("a"), ord("B"), eos, 0], [ord("a")] * 4, [ord("C")] * 4, [ord("c"), eos, 0, 0]],
                   [3, 4, 4, 2], prompts)
    rewards = Rewards(_cfg(), tok)
    try:
        raw, bad = rewards.score(batch, [{}, {}], iteration=1)
        assert bad == 0
        batch = batch.with_outputs("reward", scores=raw)
        assert raw.tolist() == [0.5, 1.0, 0.0, 1.0]  # the EOS is not part of the text scored
        penalty = overlong_penalty(batch.response_lengths, 4, 2, 0.5)
        assert torch.equal(rewards.filter_scores(batch), raw + penalty)
        moments = RunningMoments()
        scores, baseline = rewards.shaped(batch)
        assert baseline is None and torch.equal(scores, moments.normalize(raw + penalty).float())
        assert rewards.state_dict() == moments.state_dict()  # checkpointed with the trainer
        m = rewards.metrics(batch)
        assert m["reward_mean"] == pytest.approx(0.625) and m["solved_fraction"] == 0.5
    finally:
        rewards.close()


def test_rewards_check_a_reward_models_scores():
    tok = build_tokenizer("ByteLevelTokenizer", None)
    batch = _batch([[5, 6]], [2], [[1]])
    rewards = Rewards(_cfg(reward_fn=None, normalization="none", buffer_len=0, n=1), tok)
    scores, bad = rewards.check_model_scores(torch.tensor([float("nan")]), iteration=3)
    assert bad == 1
    assert scores.tolist() == [-1.0]
    strict = Rewards(_cfg(reward_fn=None, normalization="none", buffer_len=0, n=1, on_bad="error"), tok)
    with pytest.raises(BadRewardError, match="reward model rm: sample 0 of iteration 3"):
        strict.check_model_scores(torch.tensor([float("inf")]), iteration=3)


def test_named_sums_add_by_name_in_one_reduction():
    sums = NamedSums(SUM_NAMES)
    actor_out = [{"policy_loss_sum": torch.tensor(1.5), "clip_sum": torch.tensor(1.0),
                  "approx_kl_sum": torch.tensor(0.25), "tokens": torch.tensor(4.0), "loss_weight": torch.tensor(4.0)}] * 2
    sums.add(actor_out, ACTOR_SUMS)
    sums.add([{"value_loss_sum": torch.tensor(0.5), "value_clip_sum": torch.tensor(0.0), "tokens": torch.tensor(3.0)}],
             CRITIC_SUMS)
    got = sums.all_reduce()
    assert list(got) == list(SUM_NAMES)
    assert got == {"policy_loss": 3.0, "clip": 2.0, "approx_kl": 0.5, "tokens": 8.0, "value_loss": 0.5,
                   "value_clip": 0.0, "value_tokens": 3.0, "loss_weight": 8.0, "kl_loss": 0.0}


class _Engine:
    member, layout = True, SimpleNamespace(plan=SimpleNamespace(P=1), p=0)

    def __init__(self):
        self.zeroed = 0

    def grads_finite(self):
        return True

    def zero_grad(self):
        self.zeroed += 1


def test_skip_policy_skips_up_to_the_allowance_then_fails():
    faults = SimpleNamespace(nonfinite_grads=())
    policy, eng = SkipPolicy(1, rank=1, faults=faults), _Engine()
    bad = [{"policy_loss_sum": torch.tensor(float("nan"))}]
    assert policy.roles_to_skip([("actor", eng, [{"policy_loss_sum": torch.tensor(1.0)}], ("policy_loss_sum",))],
                                1, "here") == set()
    assert policy.roles_to_skip([("actor", eng, bad, ("policy_loss_sum",))], 2, "here") == {"actor"}
    assert policy.skipped == 1 and eng.zeroed == 1
    with pytest.raises(NonFiniteError, match="actor model at iteration 3 .*1 step\\(s\\) skipped already"):
        policy.roles_to_skip([("actor", eng, bad, ("policy_loss_sum",))], 3, "here")


def test_the_trainer_moves_no_data():
    """PPOTrainer calls the stages; tensors and their devices are the stages' business."""
    import ast
    from pathlib import Path

    import puzzle.dataflow.trainer

    tree = ast.parse(Path(puzzle.dataflow.trainer.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "torch" not in imported
    step = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "step")
    assert step.end_lineno - step.lineno < 40
