"""Built-in reward functions (``--reward-fn puzzle.reward_functions.builtin:NAME``).

The batched ones read the ground truth from the record field ``answer`` (see docs/grpo.md); they
are marked ``per_sample``: each sample is its own call under ``--reward-timeout``.
"""

from __future__ import annotations

from typing import List

from puzzle.reward_functions.loader import per_sample
from puzzle.reward_functions.math_checker import answers_equal, extract_answer

ANSWER_KEY = "answer"


def _truth(record: dict) -> str:
    if ANSWER_KEY not in record:
        raise KeyError(f"the prompt record has no {ANSWER_KEY!r} field (fields: {', '.join(record) or 'none'})")
    return str(record[ANSWER_KEY])


@per_sample
def math_answer(prompts: List[str], responses: List[str], records: List[dict]) -> List[float]:
    """1.0 when the response's final answer (``\\boxed{}`` or ``####``) equals the record's
    ``answer`` mathematically, else 0.0 (also when the response has no final answer)."""
    out = []
    for response, record in zip(responses, records):
        truth = _truth(record)
        truth = extract_answer(truth) or truth  # a GSM8K solution as the ground truth works too
        pred = extract_answer(response)
        out.append(1.0 if pred is not None and answers_equal(pred, truth) else 0.0)
    return out


@per_sample
def exact_match(prompts: List[str], responses: List[str], records: List[dict]) -> List[float]:
    """1.0 when the response, stripped of surrounding whitespace, is the record's ``answer``."""
    return [1.0 if r.strip() == _truth(rec).strip() else 0.0 for r, rec in zip(responses, records)]


def lowercase_fraction(prompt_text, response_text, prompt_ids, response_ids) -> float:
    """Fraction of response tokens that are lowercase ASCII letters (byte tokenizer: 26/259 at
    random), minus a small penalty for empty responses. A learnable target for tiny PPO runs."""
    if not response_ids:
        return -0.1
    return sum(1 for t in response_ids if 97 <= t <= 122) / len(response_ids)


@per_sample
def answer_prefix(prompts: List[str], responses: List[str], records: List[dict]) -> List[float]:
    """1.0 when the response starts with the record's ``answer`` (short answers, e.g. the bundled
    one-digit sums of the tiny GRPO run), else 0.0."""
    return [1.0 if r.startswith(_truth(rec).strip()) else 0.0 for r, rec in zip(responses, records)]
