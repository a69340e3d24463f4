"""Benchmark: scoring and training stage times, padded against packed micro-batches.

    python -m puzzle.bench.packing [--repeats 3] [--layouts 111 212] [--max-new-tokens 224] [--out rows.json]

In ONE run (two torchrun worlds: 1 rank at (P, D, T) = (1,1,1), 4 ranks at (2,1,2)), the same
actor model scores (old log-probs and entropy, forward only) and trains (PPO loss, forward and
backward, no optimizer step) the same rollout rows with ``--use-remove-padding`` off (rows
right-padded to the longest sequence) and on (packed, THD), and packed with token-budget
micro-batches (--use-dynamic-bsz, the budget the tokens of one padded micro-batch, rows * (prompt +
cap)). Two response-length distributions:
``long_tailed`` (exponential, mean/max ~0.2, one row at the cap) and ``all_equal`` (every
response at the cap). Wall times: max over ranks, median of ``--repeats``. Each repeat runs the
three paths back to back, each repeat starting with a different one; each row's ratios padded /
packed and padded / token-budget are the medians of the repeats' own ratios, so load from other
processes that comes and goes moves both sides of a ratio alike.

Scoring also runs packed in ``--batch-invariant-mode`` (puzzle/models/batch_invariant.py: the
arithmetic generation repeats bit for bit), in the same rotation: ``invariant_s`` and
``slowdown_invariant_over_packed`` (the median of the repeats' invariant / packed ratios), what
the mode costs a scoring stage.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from puzzle.bench.worker_ranks import run_layouts

HIDDEN, LAYERS, HEADS = 256, 4, 8
PROMPT, MAX_NEW, ROWS, MBS = 32, 224, 16, 4
LAYOUTS = {"111": (1, 1), "212": (2, 2)}  # name -> (P, T); D = world / (P * T) = 1
MODES = ("padded", "packed", "budget")
SCORING_MODES = MODES + ("invariant",)  # packed, in --batch-invariant-mode


def response_lengths(kind: str, rows: int, cap: int, seed: int = 0):
    """[rows] response lengths: all at ``cap``, or long-tailed (exponential, mean/max ~0.2) with
    the first row at the cap (the rollout's padded width)."""
    import torch

    if kind == "all_equal":
        return torch.full((rows,), cap, dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    x = torch.empty(rows).exponential_(1.0 / 0.16, generator=g).clamp(max=1.0)
    lengths = (x * cap).long().clamp(min=1)
    lengths[0] = cap
    return lengths


def _rollout(kind: str, vocab: int, max_new: int):
    import torch

    from puzzle.dataflow.batch import RolloutBatch

    R = response_lengths(kind, ROWS, max_new)
    g = torch.Generator().manual_seed(1)
    S = PROMPT + max_new
    tokens = torch.randint(0, vocab, (ROWS, S), generator=g)
    old_logprobs = -torch.rand(ROWS, max_new, generator=g) * 5
    return RolloutBatch(tokens, torch.full((ROWS,), PROMPT, dtype=torch.long), R, max_new,
                        old_logprobs=old_logprobs, advantages=torch.randn(ROWS, max_new, generator=g))


def _row(args, P: int, T: int, kind: str, stage: str, batch, times: dict, budget: int, n_budget: int) -> dict:
    """One JSON row of a layout, length distribution and stage from each mode's timed repeats."""
    max_new = args.max_new_tokens
    lengths = (batch.prompt_lengths + batch.response_lengths).float()
    padded, packed, budgeted = (statistics.median(times[mode]) for mode in MODES)
    # the ratios: medians of each repeat's own ratio (its runs are back to back, so the
    # machine's load moves both sides of it alike)
    over_packed, over_budget = (statistics.median(p / x for p, x in zip(times["padded"], times[m]))
                                for m in ("packed", "budget"))
    row = {"layout": args.layout, "P": P, "T": T, "distribution": kind, "stage": stage,
           "rows": ROWS, "micro_batch_size": MBS, "max_new_tokens": max_new, "prompt": PROMPT,
           "response_mean_over_max": round(float(batch.response_lengths.float().mean()) / max_new, 3),
           "tokens_padded": ROWS * batch.tokens.shape[1], "tokens_packed": int(lengths.sum()),
           "padded_s": round(padded, 4), "packed_s": round(packed, 4),
           "speedup_packed_over_padded": round(over_packed, 3),
           "token_budget": budget, "budget_micro_batches": n_budget, "budget_s": round(budgeted, 4),
           "speedup_budget_over_padded": round(over_budget, 3), "repeats": args.repeats,
           "hidden": HIDDEN, "layers": LAYERS, "loadavg_1min": round(os.getloadavg()[0], 2)}
    if stage == "scoring":
        row["invariant_s"] = round(statistics.median(times["invariant"]), 4)
        row["slowdown_invariant_over_packed"] = round(statistics.median(
            i / p for i, p in zip(times["invariant"], times["packed"])), 3)
    return row


def _worker(args) -> None:
    import megatron_patches

    megatron_patches.apply()
    import torch
    import torch.distributed as dist

    from puzzle.config import ModelArch
    from puzzle.parallel.groups import init_distributed, layout_for
    from puzzle.parallel.plan import ParallelPlan
    from puzzle.dataflow import steps
    from puzzle.engine.model_engine import ModelEngine
    from puzzle.dataflow.micro_batching import micro_batch_rows, micro_batches, schedule_shape

    rank, world = init_distributed()
    torch.manual_seed(0)
    MAX_NEW = args.max_new_tokens
    P, T = LAYOUTS[args.layout]
    arch = ModelArch.llama(num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=4 * HIDDEN,
                           num_attention_heads=HEADS, num_query_groups=HEADS, vocab_size=256,
                           make_vocab_size_divisible_by=128, seq_length=PROMPT + MAX_NEW)
    engine = ModelEngine("actor", arch, layout_for(ParallelPlan(P=P, D=world // (P * T), T=T)), trainable=True)
    vocab = arch.vocab_size

    def gmax(x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    budget = MBS * (PROMPT + MAX_NEW)  # the tokens of one padded micro-batch: the same memory bound

    def run(batch, stage: str, mode: str) -> float:
        packed = mode != "padded"
        mbs = micro_batches(batch, MBS, packed=packed, token_budget=budget if mode == "budget" else None)
        seq, rows, variable = schedule_shape(mbs, packed, batch.tokens.shape[1], MBS)
        engine.config.variable_seq_lengths = variable and P > 1
        if stage == "scoring":
            fn = steps.logprob_score_step(vocab, 1.0, MAX_NEW, with_entropy=True, batch_invariant=mode == "invariant")
            fwd_only = True
        else:
            fn, fwd_only = steps.actor_train_step(vocab, 1.0, MAX_NEW, 0.2, 0.0), False
            engine.zero_grad()
        dist.barrier()
        t = time.perf_counter()
        engine.forward_backward(fn, iter(mbs), len(mbs), seq, rows, forward_only=fwd_only)
        return gmax(time.perf_counter() - t)

    for kind in ("long_tailed", "all_equal"):
        batch = _rollout(kind, vocab, MAX_NEW)
        for stage in ("scoring", "training"):
            modes = SCORING_MODES if stage == "scoring" else MODES
            times = {mode: [] for mode in modes}
            for mode in modes:  # warm-up
                run(batch, stage, mode)
            for r in range(args.repeats):  # each repeat runs every mode, starting at a different one
                for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
                    times[mode].append(run(batch, stage, mode))
            row = _row(args, P, T, kind, stage, batch, times, budget, len(micro_batch_rows(batch, MBS, budget)))
            if rank == 0:
                print("ROW " + json.dumps(row), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--max-new-tokens", type=int, default=MAX_NEW, help="the response cap (rows are "
                    f"{PROMPT} prompt tokens + up to this many)")
    ap.add_argument("--out", default="", help="also write the rows to this JSON file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--layout", default="111", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    worker_args = ["--repeats", str(args.repeats), "--max-new-tokens", str(args.max_new_tokens)]
    return run_layouts("puzzle.bench.packing", args.layouts, lambda layout: LAYOUTS[layout][0] * LAYOUTS[layout][1],
                       worker_args, args.out)


if __name__ == "__main__":
    sys.exit(main())
