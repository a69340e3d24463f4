"""Earlier home of the reward-function loader and built-ins; kept so that
``--reward-fn puzzle.rewards:lowercase_fraction`` keeps working. See puzzle.reward_functions."""

from puzzle.reward_functions.builtin import lowercase_fraction
from puzzle.reward_functions.loader import load_reward_fn

__all__ = ["load_reward_fn", "lowercase_fraction"]
