"""Environments (``--env``): what answers the model's turns in a multi-turn sample.

An environment is a class, named ``module:Class`` like ``--reward-fn`` names a function, or a
built-in's registry name (``BUILTIN_ENVS``). One instance serves one sample (an episode)::

    env = Class()                   # the built-in single-turn wrapper also gets reward_fn=...
    env.reset(record)  -> Optional[str]          # the first prompt; None: the record's prompt as loaded
    env.step(turn)     -> (observation, reward, done)   # or a StepResult
    Class.turn_stops   -> the strings that end a model's turn (multi-turn: --max-turns > 1)

``turn`` is a :class:`Turn`: the model's text and token ids of this turn and everything before
it. ``observation`` (a str) is inserted after the turn when ``done`` is false; ``reward`` (a real
number or None) counts when given. Instances must pickle: each step runs in a reward worker
process (``runner.py``: spawned, a per-step timeout, a stuck step's process killed) and the
episode's instance travels there and back with it.

Faults never stop a run: a step that raises, runs past its timeout or returns anything else than
the above (``check_step``) ends its episode with an error observation and no reward, and is
counted; an observation is cut to ``MAX_OBSERVATION_CHARS`` in the worker, then to
``--max-observation-tokens`` tokens with ``TRUNCATION_MARKER`` (``cap_observation``).
"""

from __future__ import annotations

import importlib
import numbers
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from puzzle.reward_functions.loader import import_named
from puzzle.reward_functions.math_checker import answers_equal
from puzzle.reward_functions.runner import Result, Sample, call_chunk, check_value
from puzzle.reward_functions.safe_math import MathParseError, parse_math

#: the built-in environments' registry names (``--env NAME``)
BUILTIN_ENVS = {"calculator": "puzzle.reward_functions.environments:Calculator",
                "calculator_tiny": "puzzle.reward_functions.environments:ByteCalculator",
                "single_turn": "puzzle.reward_functions.environments:SingleTurnReward"}
#: an observation longer than this is cut in the worker, before it crosses the pipe
MAX_OBSERVATION_CHARS = 16384
#: appended to an observation that was cut (in characters or tokens)
TRUNCATION_MARKER = "...[truncated]"


@dataclass(frozen=True)
class Turn:
    """The model's turn ``index`` (0 first): its text and token ids (EOS removed), after the
    ``context`` (the prompt, earlier turns and observations, as token ids and text)."""
    text: str
    token_ids: List[int]
    index: int = 0
    context_text: str = ""
    context_ids: List[int] = field(default_factory=list)


@dataclass(frozen=True)
class StepResult:
    observation: str = ""
    reward: Optional[float] = None
    done: bool = True


def check_step(out: Any) -> Tuple[Optional[StepResult], Optional[str]]:
    """A step's return value as a StepResult (observation cut to ``MAX_OBSERVATION_CHARS``), or
    ``(None, why)`` when it is not (observation, reward, done) of the documented types."""
    if isinstance(out, StepResult):
        out = (out.observation, out.reward, out.done)
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        return None, f"returned {type(out).__name__} {out!r:.40}, not (observation, reward, done)"
    observation, reward, done = out
    if observation is None:
        observation = ""
    if not isinstance(observation, str):
        return None, f"returned an observation of type {type(observation).__name__}, not str"
    if reward is not None:
        reward, why = check_value(reward)
        if why is not None:
            return None, "reward " + why
    if not isinstance(done, (bool, numbers.Integral)):
        return None, f"returned done={done!r:.40}, not a bool"
    if len(observation) > MAX_OBSERVATION_CHARS:
        observation = observation[:MAX_OBSERVATION_CHARS] + TRUNCATION_MARKER
    return StepResult(observation, reward, bool(done)), None


def cap_observation(ids: List[int], max_tokens: int, marker_ids: List[int]) -> Tuple[List[int], bool]:
    """An observation's token ids cut to ``max_tokens`` (the cut ones ending in ``marker_ids``),
    and whether it was cut. ``max_tokens`` must leave room for the marker."""
    if len(ids) <= max_tokens:
        return list(ids), False
    if max_tokens < len(marker_ids):
        raise ValueError(f"max observation tokens {max_tokens} < the truncation marker's {len(marker_ids)}")
    return list(ids[:max_tokens - len(marker_ids)]) + list(marker_ids), True


# ---- naming and loading ---------------------------------------------------------------------------
def resolve_env(spec: str) -> str:
    """``module:Class`` of ``spec`` (a registry name or ``module:Class``), checked importable; a
    ValueError names ``--env`` and what is wrong."""
    path = BUILTIN_ENVS.get(spec, spec)
    if ":" not in path:
        raise ValueError(f"--env {spec!r}: unknown environment (built in: {', '.join(sorted(BUILTIN_ENVS))}; "
                         f"else module:Class)")
    module_name, cls_name, cls = import_named("--env", path)
    if not isinstance(cls, type) or not callable(getattr(cls, "step", None)):
        raise ValueError(f"--env {spec!r}: module {module_name!r} has no class {cls_name!r} with a step(turn) method")
    return path


@dataclass(frozen=True)
class EnvSpec:
    """What a worker builds environments from: ``module:Class`` and its constructor's keywords."""
    spec: str
    path: str
    kwargs: Tuple[Tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, spec: str, reward_fn: Optional[str] = None) -> "EnvSpec":
        path = resolve_env(spec)
        kwargs = (("reward_fn", reward_fn),) if path == BUILTIN_ENVS["single_turn"] else ()
        if kwargs and not reward_fn:
            raise ValueError(f"--env {spec}: needs --reward-fn (the function it wraps)")
        return cls(spec, path, kwargs)


def turn_stops(spec: EnvSpec) -> List[str]:
    """The strings that end a turn of ``spec``'s environment (its class's ``turn_stops``: the
    close of a tool call), empty when it declares none."""
    module_name, _, cls_name = spec.path.partition(":")
    stops = getattr(getattr(importlib.import_module(module_name), cls_name), "turn_stops", ())
    if isinstance(stops, str) or not all(isinstance(s, str) and s for s in stops):
        raise ValueError(f"--env {spec.spec}: turn_stops must be a sequence of non-empty strings (got {stops!r})")
    return list(stops)


def turn_stop_strings(spec: EnvSpec, tool_format=None) -> List[str]:
    """The strings that end a model's turn: the chat family's tool-call end (``tool_format``,
    prompts in the chat template), else the environment's ``turn_stops``."""
    return [tool_format.call_end] if tool_format is not None else turn_stops(spec)


def check_turn_setup(spec: EnvSpec, max_turns: int, max_observation_tokens: int, tokenizer,
                     chat_template: bool = False) -> None:
    """Multi-turn (``max_turns`` > 1) needs a turn stop (the chat template's tool format with
    ``chat_template``: refused, naming the template, when it has none; else the environment's
    ``turn_stops``) and room for the truncation marker in an observation; a ValueError names the flag."""
    if max_turns == 1:
        return
    if chat_template:
        from puzzle.reward_functions.tool_formats import tool_format_of

        tool_format_of(tokenizer)
    elif not turn_stops(spec):
        raise ValueError(f"--max-turns {max_turns}: --env {spec.spec} declares no turn_stops (the strings that end "
                         f"a turn), so its samples cannot have several turns")
    marker = len(tokenizer.encode(TRUNCATION_MARKER))
    if max_observation_tokens < marker:
        raise ValueError(f"--max-observation-tokens {max_observation_tokens}: below the {marker} tokens of the "
                         f"truncation marker {TRUNCATION_MARKER!r}")


class EnvFactory:
    """Makes the environments of one ``EnvSpec`` (in a worker or in the rank's process); ``spec``
    and ``one_sample_per_call`` are what the worker pool reads (``runner.RewardScorer``)."""

    one_sample_per_call = True

    def __init__(self, spec: EnvSpec):
        self.spec = spec
        module_name, _, cls_name = spec.path.partition(":")
        self.cls = getattr(importlib.import_module(module_name), cls_name)
        self.kwargs: Dict[str, Any] = dict(spec.kwargs)

    def make(self):
        return self.cls(**self.kwargs)


def load_env_factory(spec: EnvSpec) -> EnvFactory:
    return EnvFactory(spec)


# ---- one step of many episodes ----------------------------------------------------------------------
@dataclass
class EnvCall:
    """One step of one episode: ``env`` is its instance (None: a new one, reset with ``record``)."""
    index: int
    record: dict
    turn: Turn
    env: Any = None


@dataclass
class EnvOutcome:
    """A step's checked result and the episode's instance after it (to send with its next step)."""
    step: StepResult
    env: Any


def call_steps(factory: EnvFactory, calls: Sequence[EnvCall]) -> List[Result]:
    """Run ``calls`` here and now (no timeout): ``(EnvOutcome, None)`` or ``(None, why)``; never raises."""
    out: List[Result] = []
    for c in calls:
        try:
            env = c.env
            if env is None:
                env = factory.make()
                env.reset(c.record)
            step, why = check_step(env.step(c.turn))
        except Exception as e:
            step, why = None, f"raised {type(e).__name__}: {e}"[:300]
        out.append((EnvOutcome(step, env), None) if why is None else (None, why))
    return out


# ---- the built-ins ----------------------------------------------------------------------------------
class SingleTurnReward:
    """Today's ``--reward-fn`` as an environment: one turn, scored, done (``--env single_turn``)."""

    def __init__(self, reward_fn: str):
        from puzzle.reward_functions.loader import load_reward_fn

        self.reward = load_reward_fn(reward_fn)
        self.record: dict = {}

    def reset(self, record: dict) -> None:
        self.record = record

    def step(self, turn: Turn) -> StepResult:
        sample = Sample(index=0, prompt_text=turn.context_text, response_text=turn.text,
                        prompt_ids=list(turn.context_ids), response_ids=list(turn.token_ids), record=self.record)
        (value, why), = call_chunk(self.reward, [sample])
        if why is not None:
            raise ValueError(f"--reward-fn {self.reward.spec} {why}")
        return StepResult("", value, True)


class Calculator:
    """A calculator tool over the whitelist math parser (``safe_math.parse_math``; never ``eval``).

    A turn that ends in ``<calc>EXPR</calc>`` (the last such call counts), or in a chat family's
    JSON call of the tool ``calculator`` with ``{"expression": EXPR}`` (``tool_formats``), is a
    tool call: the observation is ``=VALUE`` (or ``=error: why``), no reward, not done. Any other turn is the
    final answer: reward 1.0 when it equals the record's ``answer`` mathematically, else 0.0, done.
    """

    CALL_OPEN, CALL_CLOSE = "<calc>", "</calc>"
    turn_stops = (CALL_CLOSE,)

    def __init__(self):
        self.answer: Optional[str] = None

    def reset(self, record: dict) -> None:
        self.answer = None if record.get("answer") is None else str(record["answer"])

    @classmethod
    def tool_call(cls, text: str) -> Optional[str]:
        """The expression of the turn's closing tool call, or None when the turn makes none."""
        end = text.rstrip().rfind(cls.CALL_CLOSE)
        if end < 0 or text.rstrip()[end:] != cls.CALL_CLOSE:
            return None
        start = text.rfind(cls.CALL_OPEN, 0, end)
        return None if start < 0 else text[start + len(cls.CALL_OPEN):end]

    @staticmethod
    def evaluate(expr: str) -> str:
        try:
            value = parse_math(expr)
            if value.free_symbols or not value.is_finite:
                return "=error: not a finite number"
            return "=" + (str(int(value)) if value.is_integer else str(value))
        except (MathParseError, ZeroDivisionError, ValueError, TypeError, RecursionError) as e:
            return f"=error: {e}"[:80]

    @staticmethod
    def family_call(text: str) -> Optional[str]:
        """A chat family's JSON tool call (``tool_formats.json_tool_call``) of the tool
        ``calculator`` with ``{"expression": ...}``: its expression, or an error observation's
        text; None when the turn makes no such call."""
        from puzzle.reward_functions.tool_formats import json_tool_call

        call = json_tool_call(text)
        if call is None:
            return None
        name, args = call
        if name != "calculator" or not isinstance(args.get("expression"), str):
            return f'=error: the tool is "calculator", its argument {{"expression": "..."}} (got {name!r})'[:120]
        return args["expression"]

    def step(self, turn: Turn) -> StepResult:
        expr = self.tool_call(turn.text)
        if expr is None:
            expr = self.family_call(turn.text)
            if expr is not None and expr.startswith("=error"):
                return StepResult(expr, None, False)
        if expr is not None:
            return StepResult(self.evaluate(expr), None, False)
        solved = self.answer is not None and answers_equal(turn.text.strip(), self.answer)
        return StepResult("", 1.0 if solved else 0.0, True)


class ByteCalculator(Calculator):
    """The calculator in a syntax a tiny byte-level model can learn from random weights (the tiny
    tool run, examples/run_grpo_tiny_tool.sh; ``--env calculator_tiny``).

    A tool call is ``[EXPR]``, its close one byte; the call may open in the prompt (the bundled
    task's prompts end in an open call holding the question's expression: ``85*91%10=[85*91``), so
    the call is read from the context and the turn together. The observation is ``=VALUE``. The
    rewards give credit in small steps, so that random sampling finds some of it:
    a final answer equal to the record's ``answer`` gets 1.0; after a call that evaluated, another
    answer gets ``CALL_REWARD`` plus ``DIGITS`` times the fraction of its characters that are digits
    plus ``PLACES`` times the number of its characters equal to the answer's at the same place over
    the longer of the two; an answer without a call gets none of this shaping credit, an episode that ends in a call
    (or is cut by the turn or token limit) nothing.
    """

    CALL_OPEN, CALL_CLOSE = "[", "]"
    turn_stops = (CALL_CLOSE,)
    CALL_REWARD, DIGITS, PLACES = 0.1, 0.1, 0.4

    def __init__(self):
        super().__init__()
        self.called = False

    def call_expression(self, turn: Turn) -> Optional[str]:
        """The expression of the turn's closing call (opened in the turn or its context), or None."""
        if not turn.text.endswith(self.CALL_CLOSE):
            return None
        text = turn.context_text + turn.text[:-len(self.CALL_CLOSE)]
        start = text.rfind(self.CALL_OPEN)
        return None if start < 0 else text[start + len(self.CALL_OPEN):]

    def answer_credit(self, text: str) -> float:
        if self.answer is None:
            return 0.0
        if answers_equal(text.strip(), self.answer):
            return 1.0
        if not text or not self.called:
            return 0.0
        same = sum(a == b for a, b in zip(text, self.answer))
        digits = sum(c.isdigit() for c in text) / len(text)
        return self.DIGITS * digits + self.PLACES * same / max(len(text), len(self.answer))

    def step(self, turn: Turn) -> StepResult:
        expr = self.call_expression(turn)
        if expr is None:
            credit = self.answer_credit(turn.text)
            return StepResult("", credit if credit == 1.0 or not self.called else credit + self.CALL_REWARD, True)
        observation = self.evaluate(expr)
        self.called = self.called or not observation.startswith("=error")
        return StepResult(observation, None, False)
