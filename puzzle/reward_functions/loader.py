"""Import ``module:function`` and tell the batched form from the per-sample one."""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class RewardFunction:
    spec: str         # "module:function" as given to --reward-fn
    fn: Callable
    batched: bool     # fn(prompts, responses, records) -> list[float]; else per sample


def _positional_count(fn: Callable):
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in params):
        return None
    return sum(1 for p in params if p.kind in kinds and p.default is inspect.Parameter.empty)


def load_reward_fn(spec: str) -> RewardFunction:
    """Import ``module:function``; a clear error names the flag and the missing piece."""
    module_name, _, fn_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"--reward-fn {spec!r}: cannot import module {module_name!r} ({e})") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"--reward-fn {spec!r}: module {module_name!r} has no function {fn_name!r}")
    n = _positional_count(fn)
    if n not in (3, 4):
        raise ValueError(f"--reward-fn {spec!r}: expected fn(prompts, responses, records) -> list[float] "
                         f"(batched) or fn(prompt_text, response_text, prompt_ids, response_ids) -> float; "
                         f"{fn_name} takes {n if n is not None else 'a variable number of'} positional arguments")
    return RewardFunction(spec=spec, fn=fn, batched=n == 3)
