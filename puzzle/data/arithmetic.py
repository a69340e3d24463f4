"""The bundled synthetic task of the tiny GRPO run: one-digit sums with checkable answers.

``python -m puzzle.data.arithmetic`` rewrites ``puzzle/data/bundled/tiny_arithmetic.jsonl``
(deterministic): every ``"a+b="`` with a + b <= 9, its answer in the record's ``answer`` field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List

PATH = Path(__file__).resolve().parent / "bundled" / "tiny_arithmetic.jsonl"


def make_records() -> List[dict]:
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10) if a + b <= 9]


if __name__ == "__main__":
    PATH.write_text("".join(json.dumps(r) + "\n" for r in make_records()))
    print(f"wrote {len(make_records())} records to {PATH}")
