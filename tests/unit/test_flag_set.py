"""The command line keeps every flag it had (tests/unit/data/train_ppo_flags.txt, the option strings
of build_parser() saved before the flags moved onto config fields): each one still parses, and no
option string is defined twice."""

import argparse
from pathlib import Path

from puzzle.arguments import build_parser, parse_args

SAVED = Path(__file__).parent / "data" / "train_ppo_flags.txt"


def _saved_flags():
    return [line.strip() for line in SAVED.read_text().splitlines() if line.strip()]


def _a_value(action):
    """A command-line value ``action`` accepts ([] for a switch)."""
    if action.nargs == 0:
        return []
    if action.choices:
        return [str(list(action.choices)[0])]
    return ["2"] if action.type in (int, float) else ["x"]


def test_no_flag_is_defined_twice():
    options = [o for a in build_parser()._actions for o in a.option_strings]
    assert len(options) == len(set(options)), sorted(o for o in set(options) if options.count(o) > 1)


def test_every_saved_flag_still_parses():
    saved = _saved_flags()
    assert len(saved) > 150  # the file holds the whole command line
    actions = {o: a for a in build_parser()._actions for o in a.option_strings}
    missing = [f for f in saved if f not in actions]
    assert not missing, missing
    for flag in saved:
        action = actions[flag]
        if isinstance(action, argparse._HelpAction):
            continue
        args = parse_args(["--seq-length", "64", flag] + _a_value(action))
        value = getattr(args, action.dest)
        if action.nargs == 0:
            expected = action.const if action.const is not None else not flag.startswith("--no-")
            assert value == expected, flag
        else:
            assert value is not None and str(value).rstrip("0").rstrip(".") == _a_value(action)[0], flag
