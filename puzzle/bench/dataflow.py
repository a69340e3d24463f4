"""Benchmark: the batch's assembly and packing per iteration, as it was against as it is.

    python -m puzzle.bench.dataflow [--repeats 5] [--layouts 141 212] [--rows 16] [--max-new-tokens 16] [--out rows.json]

In ONE run (one 4-rank torchrun world per layout, (P, D, T) = (1,4,1) and (2,1,2)), every repeat
runs one iteration's batch work both ways, back to back, each repeat starting with a different one:

- assembly: the generation output (each generating part's [b, R] tokens, [b] lengths and [b, R]
  log-probs, puzzle/dataflow/batch.py ``rollout_from_generation``) and the four scored fields of
  the tiny PPO run (old log-probs, entropy, reference log-probs, values: ``gather_outputs``) put
  together on every rank. ``old``: each field through a float64 (int64) zero buffer summed by a
  world all-reduce (``batch._LEGACY_ASSEMBLY``); ``new``: each owner's rows gathered once in the
  field's own dtype on the device (``world_rows``).
- packing: the packed micro-batches of the iteration: scoring (actor, reference, critic) and
  training (actor, critic, ``--ppo-epochs`` 2, one mini-batch of the whole batch, its rows shuffled
  per epoch), ``micro_batch_size`` 2, each rank its DP share. ``old``: every micro-batch of every
  role and pass unpads its rows again (``pack_rows``, as before the MicroBatching object); ``new``:
  ``MicroBatching.packing`` (every row of the batch unpadded once, each group of rows packed once).

The rows have the tiny PPO run's shapes (examples/run_ppo_tiny.sh: 16 rows, 16 new tokens,
prompts of 8-40 tokens, 64-token sequences) with synthetic contents: no model runs, only the
batch moves. ``*_bytes``: the bytes of the tensors the collectives deliver to a rank per
iteration (a world all-reduce's whole buffer, a broadcast's part, an all-gather's output), by
dtype; ``float64_bytes`` must be 0 for ``new``. ``rows_unpadded``: rows a rank unpadded per
iteration; ``unpads_per_row``: per row it holds (old: its DP share; new: the batch, unpadded once
for every role and pass). Times: max over ranks, medians of ``--repeats``; ratios old / new are the
medians of each repeat's own ratio (both sides see the same machine load).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

from puzzle.bench.worker_ranks import run_layouts

LAYOUTS = {"141": (1, 4, 1), "212": (2, 1, 2)}  # name -> (P, D, T) on 4 ranks
MODES = ("old", "new")
SCORED = ("old_logprobs", "entropy", "ref_logprobs", "values")
ROLES_SCORING, ROLES_TRAINING, PPO_EPOCHS, MBS, VOCAB = 3, 2, 2, 2, 256


@contextlib.contextmanager
def collective_bytes(counts: dict):
    """Count into ``counts`` (dtype name -> bytes, and ``"calls"``) the tensors that
    torch.distributed's all_reduce, broadcast, all_gather_into_tensor and all_gather deliver to
    this rank while the block runs."""
    import torch.distributed as dist

    def counted(fn, delivered):
        def call(*args, **kwargs):
            for t in delivered(*args):
                key = str(t.dtype).replace("torch.", "")
                counts[key] = counts.get(key, 0) + t.numel() * t.element_size()
            counts["calls"] = counts.get("calls", 0) + 1
            return fn(*args, **kwargs)
        return call

    saved = {name: getattr(dist, name) for name in ("all_reduce", "broadcast", "all_gather_into_tensor",
                                                      "all_gather")}
    delivered = {"all_reduce": lambda t, *a: [t], "broadcast": lambda t, *a: [t],
                 "all_gather_into_tensor": lambda out, *a: [out], "all_gather": lambda outs, *a: list(outs)}
    try:
        for name, fn in saved.items():
            setattr(dist, name, counted(fn, delivered[name]))
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def synthetic_rollout(rows: int, max_new: int, seed: int = 0):
    """(prompt ids, [rows, R] response tokens, [rows] lengths, [rows, R] log-probs): the tiny
    run's shapes, contents from ``seed`` (log-probs strictly negative inside a response, 0 after)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    prompt_lengths = torch.randint(8, 41, (rows,), generator=g).tolist()
    prompts = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in prompt_lengths]
    lengths = torch.randint(1, max_new + 1, (rows,), generator=g)
    keep = torch.arange(max_new).unsqueeze(0) < lengths.unsqueeze(1)
    tokens = torch.where(keep, torch.randint(1, VOCAB, (rows, max_new), generator=g), torch.zeros((), dtype=torch.long))
    logprobs = torch.where(keep, -torch.rand(rows, max_new, generator=g) * 5 - 1e-3, torch.zeros(()))
    return prompts, tokens, lengths, logprobs


def assemble(layout, prompts, tokens, lengths, logprobs, scored: dict, device):
    """One iteration's assembly on every rank: the generation output into a RolloutBatch, then
    the scored fields (each owner handing on its DP share's rows)."""
    from types import SimpleNamespace

    from puzzle.dataflow.batch import rollout_from_generation
    from puzzle.dataflow.micro_batching import gather_outputs

    B, R = tokens.shape
    mine = None
    if layout.member:
        part, parts, _ = layout.generation_share()
        n = B // parts
        mine = slice(part * n, (part + 1) * n)
    batch = rollout_from_generation(prompts, tokens[mine] if mine else None, lengths[mine] if mine else None,
                                    layout, R, 0, device, logprobs=logprobs[mine] if mine else None,
                                    with_logprobs=True)
    engine = SimpleNamespace(layout=layout, member=layout.member)
    n = B // layout.plan.D
    share = slice(max(layout.d, 0) * n, (max(layout.d, 0) + 1) * n)
    fields = {k: gather_outputs([{k: v[share]}], k, engine, batch) for k, v in scored.items()}
    return batch, fields


def packing_passes(batch, layout, seed: int = 0):
    """The row groups one iteration packs on this rank, one list per pass: scoring's roles over
    the DP share, then training's roles per epoch over the share of the shuffled rows."""
    import torch

    B, D = batch.size, layout.plan.D
    d, n = max(layout.d, 0), B // D
    share = torch.arange(d * n, (d + 1) * n, device=batch.device)
    passes = [share] * ROLES_SCORING
    g = torch.Generator().manual_seed(seed)
    for _ in range(PPO_EPOCHS):
        perm = torch.randperm(B, generator=g).to(batch.device)
        passes += [perm[d * n:(d + 1) * n]] * ROLES_TRAINING
    return [[rows[i:i + MBS] for i in range(0, len(rows), MBS)] for rows in passes]


def pack(batch, passes, mode: str, seq_multiple: int) -> dict:
    """Pack every group of ``passes``: ``old`` unpads each group's rows (``pack_rows``), ``new``
    through one MicroBatching. Returns the rows unpadded and the groups packed."""
    from puzzle.dataflow.micro_batching import MicroBatching, pack_rows

    if mode == "old":
        rows = 0
        for groups in passes:
            for idx in groups:
                pack_rows(batch.tokens[idx], batch.prompt_lengths[idx], batch.response_lengths[idx], seq_multiple)
                rows += len(idx)
        return {"rows_unpadded": rows, "groups_packed": sum(len(g) for g in passes)}
    micro = MicroBatching.standalone(seq_multiple)
    for groups in passes:
        for idx in groups:
            micro.packing(batch, idx)
    return {"rows_unpadded": micro.rows_unpadded, "groups_packed": micro.groups_packed}


def _worker(args) -> None:
    import megatron_patches

    megatron_patches.apply()
    import torch
    import torch.distributed as dist

    from puzzle.dataflow import batch as batch_module
    from puzzle.parallel.device import runtime
    from puzzle.parallel.groups import init_distributed, layout_for
    from puzzle.parallel.plan import ParallelPlan

    rank, world = init_distributed()
    device = runtime().device
    P, D, T = LAYOUTS[args.layout]
    layout = layout_for(ParallelPlan(P=P, D=D, T=T))
    prompts, tokens, lengths, logprobs = synthetic_rollout(args.rows, args.max_new_tokens)
    tokens, lengths, logprobs = tokens.to(device), lengths.to(device), logprobs.to(device)
    g = torch.Generator().manual_seed(1)
    scored = {k: (-torch.rand(args.rows, args.max_new_tokens, generator=g)).to(device) for k in SCORED}

    def gmax(x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def once(mode: str) -> dict:
        batch_module._LEGACY_ASSEMBLY = mode == "old"
        counts: dict = {}
        dist.barrier()
        t0 = time.perf_counter()
        with collective_bytes(counts):
            batch, fields = assemble(layout, prompts, tokens, lengths, logprobs, scored, device)
        t1 = time.perf_counter()
        packed = pack(batch, packing_passes(batch, layout), mode, T)
        t2 = time.perf_counter()
        batch_module._LEGACY_ASSEMBLY = False
        return {"assembly_s": gmax(t1 - t0), "packing_s": gmax(t2 - t1), "bytes": counts,
                "batch": batch, "fields": fields, **packed}

    results = {mode: [] for mode in MODES}
    for mode in MODES:  # warm-up, and the two paths' batches compared
        results[mode].append(once(mode))
    old, new = results["old"][0], results["new"][0]
    same = all(torch.equal(getattr(old["batch"], k), getattr(new["batch"], k))
               for k in ("tokens", "prompt_lengths", "response_lengths", "gen_logprobs"))
    same = same and all(torch.equal(old["fields"][k], new["fields"][k]) for k in SCORED)
    results = {mode: [] for mode in MODES}
    for r in range(args.repeats):
        for mode in MODES[r % 2:] + MODES[:r % 2]:
            results[mode].append(once(mode))
    if rank == 0:
        print("ROW " + json.dumps(_row(args, (P, D, T), results, same, new["batch"].size // D)), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _row(args, plan, results: dict, same: bool, share: int) -> dict:
    old, new = results["old"], results["new"]
    row = {"layout": args.layout, "P": plan[0], "D": plan[1], "T": plan[2], "ranks": 4, "rows": args.rows,
           "max_new_tokens": args.max_new_tokens, "same_batch_old_new": same}
    for what in ("assembly", "packing"):
        for mode, runs in results.items():
            row[f"{what}_s_{mode}"] = round(statistics.median(r[f"{what}_s"] for r in runs), 6)
        row[f"{what}_speedup_new_over_old"] = round(statistics.median(
            o[f"{what}_s"] / n[f"{what}_s"] for o, n in zip(old, new)), 3)
    for mode, runs in results.items():
        counts = dict(runs[0]["bytes"])
        row[f"assembly_collectives_{mode}"] = counts.pop("calls", 0)
        row[f"assembly_bytes_{mode}"] = sum(counts.values())
        row[f"assembly_bytes_by_dtype_{mode}"] = counts
        row[f"float64_bytes_{mode}"] = counts.get("float64", 0)
    row["assembly_bytes_ratio_old_over_new"] = round(row["assembly_bytes_old"] / max(1, row["assembly_bytes_new"]), 3)
    for mode, runs in results.items():
        row[f"rows_unpadded_{mode}"] = runs[0]["rows_unpadded"]
        row[f"groups_packed_{mode}"] = runs[0]["groups_packed"]
    row["unpads_per_row_old"] = row["rows_unpadded_old"] / share
    row["unpads_per_row_new"] = row["rows_unpadded_new"] / args.rows
    row.update({"repeats": args.repeats, "loadavg_1min": round(os.getloadavg()[0], 2)})
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--rows", type=int, default=16, help="rows of the batch (a multiple of 4)")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--out", default="", help="also write the rows to this JSON file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--layout", default="141", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rows % 4 or args.rows < 4:
        ap.error(f"--rows must be a positive multiple of 4 (the ranks), got {args.rows}")
    if args.worker:
        _worker(args)
        return 0
    worker_args = ["--repeats", str(args.repeats), "--rows", str(args.rows),
                   "--max-new-tokens", str(args.max_new_tokens)]
    return run_layouts("puzzle.bench.dataflow", args.layouts, lambda layout: 4, worker_args, args.out)


if __name__ == "__main__":
    sys.exit(main())
