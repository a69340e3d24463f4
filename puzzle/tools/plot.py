"""Training curves from metrics.jsonl files, without TensorBoard or W&B:
``python -m puzzle.tools.plot runs/x/metrics.jsonl [more.jsonl ...] -o curves.png`` (extra ``plot``).

One panel per quantity: reward, eval accuracy (and pass@k), KL, entropy, response length, clip
fraction, stage times. Several files are overlaid, one colour per run (labelled by its directory,
or ``--labels``). A panel whose fields no run has is left out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Dict, List, Sequence, Tuple

#: (title, fields): the panels in order; a field ending in "*" matches every field with its prefix
PANELS: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("reward", ("reward_mean", "eval/reward")),
    ("eval accuracy", ("eval/accuracy", "eval/pass@*")),
    ("KL", ("kl",)),
    ("entropy", ("entropy",)),
    ("response length", ("response_length_mean", "eval/response_length")),
    ("clip fraction", ("clip_frac",)),
    ("stage times (s)", ("time_generate", "time_score", "time_train", "time_eval")),
)
STYLES = ("-", "--", ":", "-.")


def read_metrics(path: str) -> List[dict]:
    """The lines of one metrics.jsonl (a line cut by a kill is skipped)."""
    rows = []
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and "iteration" in row:
                rows.append(row)
    return rows


def series(rows: Sequence[dict], field: str) -> Tuple[List[int], List[float]]:
    """(iterations, values) of the lines that have a number for ``field``."""
    xs, ys = [], []
    for r in rows:
        v = r.get(field)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            xs.append(int(r["iteration"]))
            ys.append(float(v))
    return xs, ys


def panel_fields(runs: Dict[str, List[dict]], fields: Sequence[str]) -> List[str]:
    """The fields of one panel present in any run, in panel order (prefix patterns expanded)."""
    present = {k for rows in runs.values() for r in rows for k in r}
    out = []
    for f in fields:
        if f.endswith("*"):
            matched = sorted((k for k in present if k.startswith(f[:-1])),
                             key=lambda k: (len(k), k))  # pass@2 before pass@16
            out += [k for k in matched if k not in out]
        elif f in present and f not in out:
            out.append(f)
    return out


def plan_panels(runs: Dict[str, List[dict]]) -> List[Tuple[str, List[str]]]:
    """(title, fields) of the panels that have data."""
    return [(title, fs) for title, fields in PANELS if (fs := panel_fields(runs, fields))]


def plot(runs: Dict[str, List[dict]], output: str, title: str = "") -> List[str]:
    """Draw the panels of ``runs`` (label -> metrics lines) into ``output``; returns the panel titles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = plan_panels(runs)
    if not panels:
        raise ValueError("no plottable field in the metrics (reward_mean, eval/accuracy, kl, entropy, ...)")
    cols = min(len(panels), 4)
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 3.6 * nrows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (name, fields) in zip(axes.flat, panels):
        for i, (label, rows) in enumerate(runs.items()):
            for j, field in enumerate(fields):
                xs, ys = series(rows, field)
                if not xs:
                    continue
                legend = (f"{label}: {field}" if len(runs) > 1 else field) if len(fields) > 1 else label
                marker = "o" if field.startswith("eval/") or len(xs) <= 12 else None
                # one run: a colour per field; several: a colour per run, a line style per field
                style, color = ("-", colors[j % len(colors)]) if len(runs) == 1 else \
                    (STYLES[j % len(STYLES)], colors[i % len(colors)])
                ax.plot(xs, ys, style, color=color, marker=marker,
                        markersize=4, linewidth=1.4, label=legend)
        ax.set_title(name)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        if len(fields) > 1 or len(runs) > 1:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.remove()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return [name for name, _ in panels]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="puzzle.tools.plot", description=__doc__.splitlines()[0])
    p.add_argument("metrics", nargs="+", help="metrics.jsonl files (several: overlaid)")
    p.add_argument("-o", "--output", default="curves.png", help="image file (its extension picks the format)")
    p.add_argument("--labels", nargs="+", help="one label per file (default: each file's directory)")
    p.add_argument("--title", default="")
    args = p.parse_args(argv)
    if args.labels and len(args.labels) != len(args.metrics):
        print(f"error: --labels: {len(args.labels)} labels for {len(args.metrics)} files", file=sys.stderr)
        return 2
    labels = args.labels or [os.path.basename(os.path.dirname(os.path.abspath(m))) or m for m in args.metrics]
    runs = {}
    for label, path in zip(labels, args.metrics):
        try:
            runs[label if label not in runs else f"{label} ({path})"] = read_metrics(path)
        except OSError as e:
            print(f"error: cannot read {path}: {e.strerror}", file=sys.stderr)
            return 2
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print('error: the plot tool needs matplotlib: pip install -e ".[plot]"', file=sys.stderr)
        return 2
    try:
        names = plot(runs, args.output, args.title)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}: {', '.join(names)}")
    return 0


if __name__ == "__main__":
    from puzzle.parallel import launcher

    launcher.exit_process(main())
