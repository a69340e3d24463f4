"""The bundled task of the tiny tool run (examples/run_grpo_tiny_tool.sh): sums of two two-digit
numbers with three-digit totals (100..198), which a tiny byte-level model cannot learn to add in
minutes, but can answer by calling the calculator (``--env calculator_tiny``) and copying its
result. (With totals of two and three digits mixed, the copy's distance varies with the answer's
length: in 150 iterations the model learned to call and to write digits, not to copy.)

Each prompt asks the sum and opens a tool call holding its expression, in the byte calculator's
syntax (``puzzle.reward_functions.environments.ByteCalculator``: ``[EXPR]``): ``"23+45=[23+45"``.
The model then either answers at once (the call stays an unclosed bracket), or closes the call
with ``]`` (one byte), reads the observation ``=68`` and answers ``68``. The answer is in each
record's ``answer`` field.

``python -m puzzle.data.tool_sums`` rewrites (deterministic) the training prompts
``puzzle/data/bundled/tiny_tool_sums.jsonl`` and the held-out eval prompts
``puzzle/data/bundled/tiny_tool_sums_eval.jsonl`` (no sum of one is in the other).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import List

BUNDLED = Path(__file__).resolve().parent / "bundled"
PATH = BUNDLED / "tiny_tool_sums.jsonl"
EVAL_PATH = BUNDLED / "tiny_tool_sums_eval.jsonl"
TRAIN_RECORDS, EVAL_RECORDS = 2000, 128


def record(a: int, b: int) -> dict:
    return {"prompt": f"{a}+{b}=[{a}+{b}", "answer": str(a + b)}


def make_records(seed: int = 0) -> List[List[dict]]:
    """The training and eval records: every sum a+b >= 100 of two-digit a, b, shuffled with
    ``seed``, split into ``TRAIN_RECORDS`` and ``EVAL_RECORDS``."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100) if a + b >= 100]
    random.Random(seed).shuffle(pairs)
    return [[record(a, b) for a, b in pairs[:TRAIN_RECORDS]],
            [record(a, b) for a, b in pairs[TRAIN_RECORDS:TRAIN_RECORDS + EVAL_RECORDS]]]


def write(path: Path, records: List[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    print(f"wrote {len(records)} records to {path}")


if __name__ == "__main__":
    train, held_out = make_records()
    write(PATH, train)
    write(EVAL_PATH, held_out)
