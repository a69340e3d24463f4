"""The bundled synthetic task of the tiny GRPO run: one-digit sums with checkable answers.

``python -m puzzle.data.arithmetic`` rewrites (deterministic) the training prompts
``puzzle/data/bundled/tiny_arithmetic.jsonl``, every ``"a+b="`` with a + b <= 9, and the held-out
eval prompts ``puzzle/data/bundled/tiny_arithmetic_eval.jsonl``, the same sums written after a
space (``" a+b="``: no eval prompt is a training prompt); the answer is in each record's ``answer``
field. ``make_records(terms=3)`` gives three-term sums, a harder held-out set.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import List

BUNDLED = Path(__file__).resolve().parent / "bundled"
PATH = BUNDLED / "tiny_arithmetic.jsonl"
EVAL_PATH = BUNDLED / "tiny_arithmetic_eval.jsonl"


def make_records(terms: int = 2, prefix: str = "") -> List[dict]:
    """Every sum of ``terms`` one-digit numbers whose total is one digit, in lexicographic order,
    each prompt after ``prefix``."""
    return [{"prompt": prefix + "+".join(map(str, digits)) + "=", "answer": str(sum(digits))}
            for digits in itertools.product(range(10), repeat=terms) if sum(digits) <= 9]


def write(path: Path, records: List[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    print(f"wrote {len(records)} records to {path}")


if __name__ == "__main__":
    write(PATH, make_records(terms=2))
    write(EVAL_PATH, make_records(terms=2, prefix=" "))
