"""Compare two runs' metrics.jsonl: ``python -m puzzle.tools.compare_metrics A B [--rtol R]``.

Every numeric field of every iteration except timings must agree: exactly by default (a refactor
must not move the metrics), or within ``--rtol`` relative (``|a - b| <= rtol * max(|a|, |b|) +
--atol``), e.g. the same run on a GPU and on the CPU. Prints the differences (``--max-diffs``: each
field's largest one); exit 1 on any.
"""

from __future__ import annotations

import argparse
import json
from typing import Dict, Optional

#: fields that measure the machine, not the run
MACHINE_FIELDS = ("time_", "samples_per_sec", "tokens_per_sec", "switch_seconds", "mem_peak_")


def compare(a: list, b: list, rtol: float = 0.0, atol: float = 0.0,
            field_atol: Optional[Dict[str, float]] = None, fields_of_a: bool = False) -> list:
    """[(iteration, field, a, b)] of every disagreement (a missing line or field counts).

    ``field_atol``: an absolute tolerance of its own for named fields, e.g. fractions of tokens
    at a clip boundary, where a last-bit difference moves a whole token. ``fields_of_a``: only
    the fields ``a`` has are compared (a newer run that logs more fields than a baseline)."""
    field_atol = field_atol or {}
    diffs = []
    if len(a) != len(b):
        diffs.append((None, "lines", len(a), len(b)))
    for x, y in zip(a, b):
        for k in sorted(set(x) if fields_of_a else set(x) | set(y)):
            if k.startswith(MACHINE_FIELDS):
                continue
            u, v = x.get(k), y.get(k)
            same = u == v
            if not same and isinstance(u, (int, float)) and isinstance(v, (int, float)):
                same = abs(u - v) <= rtol * max(abs(u), abs(v)) + field_atol.get(k, atol)
            if not same:
                diffs.append((x.get("iteration"), k, u, v))
    return diffs


def max_differences(a: list, b: list) -> Dict[str, tuple]:
    """Per numeric field: (largest |a - b|, largest |a - b| / max(|a|, |b|), the iteration of the
    largest absolute one) over the iterations both runs logged."""
    out: Dict[str, tuple] = {}
    for x, y in zip(a, b):
        for k in sorted(set(x) & set(y)):
            u, v = x[k], y[k]
            if k.startswith(MACHINE_FIELDS) or not all(isinstance(t, (int, float)) for t in (u, v)):
                continue
            d = abs(u - v)
            rel = d / max(abs(u), abs(v)) if d else 0.0
            best = out.get(k, (0.0, 0.0, None))
            out[k] = (max(best[0], d), max(best[1], rel), x.get("iteration") if d > best[0] else best[2])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="puzzle.tools.compare_metrics")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--rtol", type=float, default=0.0)
    p.add_argument("--atol", type=float, default=0.0)
    p.add_argument("--field-atol", action="append", default=[], metavar="FIELD=ATOL",
                   help="an absolute tolerance for one field (repeatable)")
    p.add_argument("--fields-of-a", action="store_true",
                   help="compare only the fields A logs (B may log more, e.g. a baseline from before new metrics)")
    p.add_argument("--max-diffs", action="store_true",
                   help="also print each field's largest absolute and relative difference")
    args = p.parse_args(argv)
    try:
        field_atol = {f: float(v) for f, _, v in (x.partition("=") for x in args.field_atol)}
    except ValueError:
        p.error(f"--field-atol takes FIELD=ATOL (got {args.field_atol})")
    load = lambda f: [json.loads(line) for line in open(f) if line.strip()]  # noqa: E731
    a, b = load(args.a), load(args.b)
    diffs = compare(a, b, args.rtol, args.atol, field_atol, fields_of_a=args.fields_of_a)
    for it, k, u, v in diffs[:50]:
        print(f"iteration {it}: {k}: {u!r} != {v!r}")
    if args.max_diffs:
        for k, (d, rel, it) in max_differences(a, b).items():
            print(f"max diff {k}: abs {d:.3g} rel {rel:.3g}" + (f" (iteration {it})" if d else ""))
    print(f"compared {len(a)} lines: {len(diffs)} differences (rtol {args.rtol}, atol {args.atol})")
    return 1 if diffs else 0


if __name__ == "__main__":
    from puzzle.parallel import launcher

    launcher.exit_process(main())
