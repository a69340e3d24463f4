"""Environments for the environment tests (imported by name in the reward worker processes)."""

import time


class Faulty:
    """One turn: the turn's text picks the fault."""

    def reset(self, record):
        self.record = record

    def step(self, turn):
        if turn.text == "hang":
            time.sleep(600)
        if turn.text == "raise":
            raise RuntimeError("tool broke")
        if turn.text == "huge":
            return "x" * 100_000, None, False
        if turn.text == "garbage":
            return {"not": "a step"}
        if turn.text == "nan":
            return "", float("nan"), True
        return "ok " + turn.text, 1.0, True


class Counter:
    """Counts its own steps: the instance travels with the episode from step to step."""

    def reset(self, record):
        self.n = 0

    def step(self, turn):
        self.n += 1
        return f"step {self.n}", None, self.n >= 2


class NotAnEnvironment:  # no step()
    pass
