"""Import ``module:function`` and tell the batched form from the per-sample one."""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Callable


PER_SAMPLE_ATTR = "reward_per_sample"


def per_sample(fn: Callable) -> Callable:
    """Marks a batched reward function whose samples are independent of each other (the built-in
    checkers): it is then called one sample at a time, each call under ``--reward-timeout``, so a
    stuck response costs one timeout and one bad reward instead of its whole call."""
    setattr(fn, PER_SAMPLE_ATTR, True)
    return fn


@dataclass(frozen=True)
class RewardFunction:
    spec: str         # "module:function" as given to --reward-fn
    fn: Callable
    batched: bool     # fn(prompts, responses, records) -> list[float]; else per sample
    marked_per_sample: bool = False  # batched, but called one sample at a time (per_sample)

    @property
    def one_sample_per_call(self) -> bool:
        return not self.batched or self.marked_per_sample


def _positional_count(fn: Callable):
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(p.kind == inspect.Parameter.VAR_POSITIONAL for p in params):
        return None
    return sum(1 for p in params if p.kind in kinds and p.default is inspect.Parameter.empty)


def import_named(flag: str, spec: str) -> tuple:
    """``module:name`` imported: (the module's name, the name, its attribute or None); a
    ValueError names ``flag`` and the module when the module cannot be imported."""
    module_name, _, name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{flag} {spec!r}: cannot import module {module_name!r} ({e})") from None
    return module_name, name, getattr(module, name, None)


def load_reward_fn(spec: str) -> RewardFunction:
    """Import ``module:function``; a clear error names the flag and the missing piece."""
    module_name, fn_name, fn = import_named("--reward-fn", spec)
    if not callable(fn):
        raise ValueError(f"--reward-fn {spec!r}: module {module_name!r} has no function {fn_name!r}")
    n = _positional_count(fn)
    if n not in (3, 4):
        raise ValueError(f"--reward-fn {spec!r}: expected fn(prompts, responses, records) -> list[float] "
                         f"(batched) or fn(prompt_text, response_text, prompt_ids, response_ids) -> float; "
                         f"{fn_name} takes {n if n is not None else 'a variable number of'} positional arguments")
    return RewardFunction(spec=spec, fn=fn, batched=n == 3, marked_per_sample=bool(getattr(fn, PER_SAMPLE_ATTR, False)))
