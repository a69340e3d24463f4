"""Reward functions given by ``--reward-fn module:function``.

A reward function takes one sample and returns a float::

    fn(prompt_text: str, response_text: str, prompt_ids: list[int], response_ids: list[int]) -> float

The built-in ones here are learnable targets for tiny runs and tests.
"""

from __future__ import annotations

import importlib
from typing import Callable


def lowercase_fraction(prompt_text, response_text, prompt_ids, response_ids) -> float:
    """Fraction of response tokens that are lowercase ASCII letters (byte tokenizer: 26/259 at
    random), minus a small penalty for empty responses."""
    if not response_ids:
        return -0.1
    return sum(1 for t in response_ids if 97 <= t <= 122) / len(response_ids)


def load_reward_fn(spec: str) -> Callable:
    """Import ``module:function``; a clear error names the flag and the missing piece."""
    module_name, _, fn_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"--reward-fn {spec!r}: cannot import module {module_name!r} ({e})") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"--reward-fn {spec!r}: module {module_name!r} has no function {fn_name!r}")
    return fn
