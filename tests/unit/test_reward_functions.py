"""Reward functions: loading (batched / per-sample), value checks, timeouts, the process pool,
the math checker and the built-ins."""

import math

import pytest

from puzzle.reward_functions import Sample, load_reward_fn, score_samples
from puzzle.reward_functions.builtin import answer_prefix, exact_match, math_answer
from puzzle.reward_functions.distributed import RolloutRewarder
from puzzle.reward_functions.math_checker import answers_equal, extract_answer
from puzzle.reward_functions.runner import BadRewardError, check_value

FX = "tests.unit.reward_fixtures"


def samples(texts, values=None):
    return [Sample(index=i, prompt_text="p", response_text=t, prompt_ids=[1], response_ids=[2] * len(t),
                   record={"value": v} if values else {}) for i, (t, v) in
            enumerate(zip(texts, values or [None] * len(texts)))]


def test_loader_tells_the_forms_apart_and_names_the_flag():
    assert load_reward_fn(f"{FX}:batched_by_record").batched
    assert not load_reward_fn(f"{FX}:per_sample_len").batched
    assert load_reward_fn(f"{FX}:three_args_with_default").batched
    assert not load_reward_fn("puzzle.reward_functions.builtin:lowercase_fraction").batched
    with pytest.raises(ValueError, match="--reward-fn 'puzzle.nope:f': cannot import module 'puzzle.nope'"):
        load_reward_fn("puzzle.nope:f")
    with pytest.raises(ValueError, match="has no function 'missing'"):
        load_reward_fn(f"{FX}:missing")
    with pytest.raises(ValueError, match="variable number"):
        load_reward_fn(f"{FX}:varargs")


def test_check_value():
    import numpy as np
    import torch

    assert check_value(1) == (1.0, None) and check_value(True) == (1.0, None)
    assert check_value(np.float32(0.5)) == (0.5, None) and check_value(torch.tensor(2.0)) == (2.0, None)
    for bad in ("0.5", None, [1.0], float("nan"), float("inf"), torch.tensor([1.0, 2.0])):
        v, why = check_value(bad)
        assert v is None and why


def test_bad_values_in_process_per_sample():
    fn = load_reward_fn(f"{FX}:per_sample_faulty")
    out = score_samples(fn, samples(["ok", "raise", "nan", "str", "hang", "ok"]), timeout=0.5)
    assert out[0] == (1.0, None) and out[5] == (1.0, None)
    assert "raised ValueError: bad sample" in out[1][1]
    assert "nan" in out[2][1] and "str" in out[3][1] and "timed out after 0.5 s" in out[4][1]


def test_batched_chunk_faults():
    fn = load_reward_fn(f"{FX}:batched_by_record")
    out = score_samples(fn, samples(["a", "b", "c"], [0.25, "0.5", float("inf")]))
    assert out[0] == (0.25, None) and out[1][0] is None and out[2][0] is None
    out = score_samples(fn, samples(["a", "b"], [1.0, "raise"]))
    assert all(v is None and "RuntimeError: boom" in why for v, why in out)
    out = score_samples(load_reward_fn(f"{FX}:wrong_length"), samples(["a", "b"]))
    assert all("returned 1 values for 2 samples" in why for _, why in out)


def test_process_pool_with_timeouts():
    """Two workers: a hanging per-sample call is cut at its timeout, the pool is replaced, and the
    next calls still score (in the fresh pool)."""
    fn = load_reward_fn(f"{FX}:per_sample_faulty")
    out = score_samples(fn, samples(["ok", "hang", "raise", "ok", "ok"]), workers=2, timeout=3.0)
    assert [v for v, _ in out] == [1.0, None, None, 1.0, 1.0]
    assert "timed out" in out[1][1] and "ValueError" in out[2][1]
    batched = load_reward_fn(f"{FX}:batched_by_record")
    out = score_samples(batched, samples(list("abcd"), [1.0, 2.0, 3.0, "hang"]), workers=2, timeout=1.0)
    assert [v for v, _ in out] == [1.0, 2.0, None, None]  # the hanging chunk's samples only


def test_rollout_rewarder_policies(capsys):
    make = {i: s for i, s in enumerate(samples(["a", "b", "c"], [1.0, float("nan"), "0.5"]))}.__getitem__
    r = RolloutRewarder(f"{FX}:batched_by_record", bad_reward_value=-1.0)
    scores, bad = r.score(make, 3, iteration=7)
    assert scores.tolist() == [1.0, -1.0, -1.0] and bad == 2
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and f"{FX}:batched_by_record: sample 1 of iteration 7" in err
    r.score(make, 3, iteration=8)
    assert "warning" not in capsys.readouterr().err  # one warning per run; later ones are counted
    strict = RolloutRewarder(f"{FX}:batched_by_record", on_bad_reward="error")
    with pytest.raises(BadRewardError, match="sample 1 of iteration 3 returned nan"):
        strict.score(make, 3, iteration=3)


def test_math_checker():
    assert extract_answer("so the answer is \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"
    assert extract_answer("\\boxed{1} then \\boxed{x^{2}}") == "x^{2}"
    assert extract_answer("Natalia sold 48/2 = 24 clips.\n#### 72") == "72"
    assert extract_answer("no answer here") is None
    assert answers_equal("\\frac{1}{2}", "0.5") and answers_equal("1,000", "1000")
    assert answers_equal("\\dfrac{2}{4}", "\\frac{1}{2}") and answers_equal("$3$", "3.")
    assert answers_equal("2\\sqrt{2}", "\\sqrt{8}") and not answers_equal("3", "4")
    assert not answers_equal("", "0")


def test_builtins():
    recs = [{"answer": "\\frac{1}{2}"}, {"answer": "Janet makes 9 * 2 = $18.\n#### 18"}, {"answer": "7"}]
    assert math_answer(["p"] * 3, ["\\boxed{0.5}", "#### 18", "7"], recs) == [1.0, 1.0, 0.0]
    assert exact_match(["p"] * 2, [" 7 ", "77"], [{"answer": "7"}] * 2) == [1.0, 0.0]
    assert answer_prefix(["p"] * 3, ["7x", "x7", ""], [{"answer": "7"}] * 3) == [1.0, 0.0, 0.0]
    with pytest.raises(KeyError, match="no 'answer' field"):
        exact_match(["p"], ["7"], [{"solution": "7"}])
    assert math.isfinite(load_reward_fn("puzzle.reward_functions.builtin:lowercase_fraction").fn("", "ab", [], [97, 98]))


def test_records_carry_the_other_fields_to_the_reward(tmp_path):
    import json

    from puzzle.data.arithmetic import PATH, make_records
    from puzzle.data.prompts import load_prompt_dataset
    from puzzle.data.tokenizers import build_tokenizer

    tok = build_tokenizer("ByteLevelTokenizer", None)
    f = tmp_path / "math.jsonl"
    f.write_text('{"prompt": "1+1=", "answer": "2", "id": 7}\n{"prompt": 5}\n{"prompt": "2+2=", "answer": "4"}\n')
    ds = load_prompt_dataset(str(f), tok, skip_bad_records=True)
    assert ds.records == [{"answer": "2", "id": 7}, {"answer": "4"}] and len(ds.prompts) == 2
    bundled = [json.loads(x) for x in open(PATH)]
    assert bundled == make_records() and len(bundled) == 55  # the file is what its generator writes
    ds = load_prompt_dataset(str(PATH), tok)
    assert ds.records[0] == {"answer": "0"} and tok.decode(ds.prompts[0]) == "0+0="


def test_model_scores_follow_the_same_policy(capsys):
    import torch

    from puzzle.reward_functions.distributed import BadRewardPolicy

    pol = BadRewardPolicy("default", 0.5)
    scores, bad = pol.check_scores(torch.tensor([1.0, float("nan"), float("-inf")]), "reward model rm", 4)
    assert scores.tolist() == [1.0, 0.5, 0.5] and bad == 2
    assert "reward model rm: sample 1 of iteration 4 is nan" in capsys.readouterr().err
    same, bad = pol.check_scores(torch.tensor([2.0]), "reward model rm", 5)
    assert same.tolist() == [2.0] and bad == 0
    with pytest.raises(BadRewardError, match="sample 0 of iteration 1 is inf"):
        BadRewardPolicy("error").check_scores(torch.tensor([float("inf")]), "reward model rm", 1)
