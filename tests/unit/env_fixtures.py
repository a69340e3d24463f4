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


class Vowels:
    """Multi-turn: a turn ends at a vowel, answered with "ok"; reward 0.5 per turn."""
    turn_stops = tuple("aeiou")

    def reset(self, record):
        pass

    def step(self, turn):
        return "ok", 0.5, False


class Shouty:
    """Multi-turn: "boom" raises, "long" answers 100 characters, "end" is done with reward 1."""
    turn_stops = (";",)

    def reset(self, record):
        pass

    def step(self, turn):
        if turn.text.startswith("boom"):
            raise RuntimeError("boom")
        if turn.text.startswith("long"):
            return "y" * 100, 0.25, False
        return ("", 1.0, True) if turn.text.startswith("end") else ("fine", None, False)


class Tally:
    """Multi-turn and stateful: each step answers how many steps its instance has taken and gives
    a quarter per step; done at the third step (a carried episode must keep its instance)."""
    turn_stops = (";",)

    def reset(self, record):
        self.n = int(record.get("start", 0))

    def step(self, turn):
        self.n += 1
        return f"#{self.n}:==", 0.25 * self.n, self.n >= 3
