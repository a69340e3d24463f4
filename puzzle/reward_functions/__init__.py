"""Reward functions given by ``--reward-fn module:function`` (verifiable rewards).

Two forms are accepted (``loader.load_reward_fn`` tells them apart by their positional parameters):

* batched (three parameters)::

      fn(prompts: list[str], responses: list[str], records: list[dict]) -> list[float]

  ``records[i]`` holds the other fields of sample i's dataset record (e.g. ``"answer"``);
* per sample (four parameters, the earlier API)::

      fn(prompt_text: str, response_text: str, prompt_ids: list[int], response_ids: list[int]) -> float

Every value is checked: a value that is not a number (e.g. the string ``"0.5"``), NaN or inf, a
call that raises or one that runs past ``--reward-timeout`` follows ``--on-bad-reward``. The
timeout is per sample for per-sample functions and for batched ones marked ``@per_sample`` (their
samples are independent: each is its own call); any other batched call gets ``timeout x its
samples`` as one per-call limit. A timed-out call's worker process is killed (runner.py).
Built in: ``puzzle.reward_functions.builtin:math_answer`` (``\\boxed{}`` / ``####`` answers),
``:exact_match``, ``:lowercase_fraction``.
"""

from puzzle.reward_functions.loader import RewardFunction, load_reward_fn, per_sample
from puzzle.reward_functions.runner import BadRewardError, Sample, score_samples

__all__ = ["BadRewardError", "RewardFunction", "Sample", "load_reward_fn", "per_sample", "score_samples"]
