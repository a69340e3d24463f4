"""Reward functions with known faults, imported by --reward-fn in the reward tests."""

import time


def per_sample_len(prompt_text, response_text, prompt_ids, response_ids):
    return float(len(response_ids))


def batched_by_record(prompts, responses, records):
    """Per sample: the record's 'value' field as is (numbers, strings, NaN...), 'raise' raises,
    'hang' sleeps for a minute."""
    out = []
    for r in records:
        v = r["value"]
        if v == "raise":
            raise RuntimeError("boom")
        if v == "hang":
            time.sleep(60)
        out.append(v)
    return out


def per_sample_faulty(prompt_text, response_text, prompt_ids, response_ids):
    if response_text == "raise":
        raise ValueError("bad sample")
    if response_text == "hang":
        time.sleep(60)
    if response_text == "nan":
        return float("nan")
    if response_text == "str":
        return "0.5"
    return 1.0


def wrong_length(prompts, responses, records):
    return [1.0]


def three_args_with_default(a, b, c, d=None):
    return [0.0] * len(a)


def varargs(*a):
    return 0.0


def half_constant(prompt_text, response_text, prompt_ids, response_ids):
    """0 for prompts of even length (their groups are all equal: dynamic sampling drops them), else
    the fraction of lowercase letters in the response."""
    if len(prompt_ids) % 2 == 0 or not response_ids:
        return 0.0
    return sum(1 for t in response_ids if 97 <= t <= 122) / len(response_ids)
