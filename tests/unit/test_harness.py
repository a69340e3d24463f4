"""The shared test helpers (tests/harness.py): the tiny flags come from the launch scripts and
parse; the metric comparison fails where it should."""

import pytest

from puzzle.arguments import parse_args
from tests.harness import TINY_CLI, TINY_GRPO, TINY_MODEL, assert_same_metrics, script_arrays, tiny_flags


def test_tiny_flags_are_the_scripts_arrays_and_parse():
    arrays = script_arrays()
    assert list(arrays) == ["DISTRIBUTED_ARGS", "MODEL_ARGS", "PARALLEL_ARGS", "TRAIN_ARGS", "PPO_ARGS", "LOG_ARGS"]
    assert TINY_MODEL == arrays["MODEL_ARGS"] and TINY_MODEL[:2] == ["--num-layers", "2"]
    assert "# actor and reference" not in " ".join(arrays["PARALLEL_ARGS"])  # comments dropped
    args = parse_args(tiny_flags())
    assert (args.hidden_size, args.num_query_groups, args.train_iters, args.rollout_batch_size) == (64, 2, 24, 16)
    grpo = parse_args(tiny_flags(TINY_GRPO))
    assert (grpo.advantage_estimator, grpo.n_samples_per_prompt, grpo.seq_length) == ("grpo", 16, 16)
    assert parse_args(TINY_CLI).reward_fn == "puzzle.reward_functions.builtin:lowercase_fraction"


def test_assert_same_metrics():
    a = [{"iteration": 1, "x": 1.0, "t": 5.0}, {"iteration": 2, "x": 2.0, "t": 6.0}]
    b = [{"iteration": 1, "x": 1.0, "t": 7.0}, {"iteration": 2, "x": 2.0 + 1e-7, "t": 8.0}]
    assert_same_metrics(a, b, ["x"], rel=1e-6)
    assert_same_metrics(a, a)
    assert_same_metrics(a[:1], b, skip=("t",), iterations=[1])
    with pytest.raises(AssertionError):
        assert_same_metrics(a, b, ["x"])  # exact
    with pytest.raises(AssertionError):
        assert_same_metrics(a, b, skip=("x",))  # t differs
    with pytest.raises(AssertionError):
        assert_same_metrics(a[:1], b)  # other iterations
    with pytest.raises(AssertionError):
        assert_same_metrics([{"iteration": 1}], [{"iteration": 1, "x": 1.0}])  # a key missing
