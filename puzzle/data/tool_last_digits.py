"""The bundled task of the tiny tool run (examples/run_grpo_tiny_tool.sh): the last digit of a
product of two two-digit numbers with a four-digit value, ``"85*91%10="`` (answer ``5``), which a
tiny byte-level model answers by calling the calculator (``--env calculator_tiny``) and reading the
last digit of its result. Alone it can only learn the table of the operands' last digits (100
entries), more slowly: in the tiny tool run's 150 iterations it reaches a solved fraction of ~0.4
without the tool, ~0.7-0.9 with it (docs/grpo.md).

Each prompt asks the product's last digit and opens a tool call holding the product, in the byte
calculator's syntax (``puzzle.reward_functions.environments.ByteCalculator``: ``[EXPR]``):
``"85*91%10=[85*91"``. The model then either answers at once (the call stays an unclosed bracket),
or closes the call with ``]`` (one byte), reads the observation ``=7735`` and answers ``5``. The
answer is in each record's ``answer`` field.

Why one digit, the last one: the answer is then the token the model reads when it writes it, a
copy that needs no attention. A multi-digit answer copied from the observation (``=129`` then
``129``, or ``=68`` then ``68``) needs an attention head that looks one or two places back, and in
GRPO from random weights the 2-layer actor learned to call and to write digits, then collapsed on
one digit ("111", "99") before such a head formed (docs/grpo.md, the tiny tool run).

``python -m puzzle.data.tool_last_digits`` rewrites (deterministic) the training prompts
``puzzle/data/bundled/tiny_tool_last_digits.jsonl`` and the held-out eval prompts
``puzzle/data/bundled/tiny_tool_last_digits_eval.jsonl`` (no product of one is in the other).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import List

BUNDLED = Path(__file__).resolve().parent / "bundled"
PATH = BUNDLED / "tiny_tool_last_digits.jsonl"
EVAL_PATH = BUNDLED / "tiny_tool_last_digits_eval.jsonl"
TRAIN_PER_DIGIT, EVAL_PER_DIGIT = 200, 12


def record(a: int, b: int) -> dict:
    return {"prompt": f"{a}*{b}%10=[{a}*{b}", "answer": str(a * b % 10)}


def make_records(seed: int = 0) -> List[List[dict]]:
    """The training and eval records, from the products a*b >= 1000 of two-digit a, b (the
    observation is then always five bytes), shuffled with ``seed``: ``TRAIN_PER_DIGIT`` training
    and ``EVAL_PER_DIGIT`` eval records for each last digit 0..9, shuffled again.

    Every answer digit is equally frequent: with the products' own mix (0 in 26% of them, each odd
    digit but 5 in 4%), GRPO first learns a few frequent digits, whatever the observation, and the
    policy collapses on them before the copy is learned ("4" and "2", solved_fraction 0.19)."""
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100) if a * b >= 1000]
    rng.shuffle(pairs)
    train, held_out = [], []
    for digit in range(10):
        of_digit = [record(a, b) for a, b in pairs if a * b % 10 == digit]
        train += of_digit[:TRAIN_PER_DIGIT]
        held_out += of_digit[TRAIN_PER_DIGIT:TRAIN_PER_DIGIT + EVAL_PER_DIGIT]
    rng.shuffle(train)
    rng.shuffle(held_out)
    return [train, held_out]


def write(path: Path, records: List[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    print(f"wrote {len(records)} records to {path}")


if __name__ == "__main__":
    train, held_out = make_records()
    write(PATH, train)
    write(EVAL_PATH, held_out)
