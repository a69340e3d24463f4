"""Benchmark: the inter-stage switch (PUZZLE §5.1-5.2) vs megatron-core's resharding refit.

    python -m puzzle.bench.switch [--repeats 5] [--segments 8] [--only all|dense|moe|lora] [--out rows.json]

Spawns its own 4-rank torchrun world (gloo, OMP_NUM_THREADS=1). One model (GQA + SwiGLU,
untied: 4 layers, hidden 256, 8 heads / 4 query groups, ffn 512, vocab 1024) and its mixture-of-experts
version (every MLP 4 experts of ffn 512, top-2), the actor at every source plan as a trainable
ModelEngine, and for each plan pair (dense: and its reverse; MoE: training layouts at T = 1 to
generation layouts of another E), in ONE run:

* bytes: ``bytes_moved_max_rank`` (measured, bytes received by the busiest rank),
  ``lower_bound_bytes_max_rank`` (bytes the busiest rank lacks), ``allgather_bytes_max_rank``
  (DeepSpeed-Chat-style full all-gather baseline), from the routing table;
* ``time_puzzle_s``: puzzle's switch into a pre-allocated shadow model (routing executor);
* ``time_mcore_refit_s``: ``megatron.core.resharding.swap_model_weights(src, dst, 'gloo')``
  between the same two models (its plan is cached after the first call; the first call, which
  builds the plan on rank 0, is ``time_mcore_first_s``), timed in turns with puzzle's switch of
  the same case (``time_puzzle_alongside_mcore_s``; ``puzzle_vs_mcore_refit`` = their ratio, so
  both sides of it see the same machine load); ``mcore_matches_puzzle``: bitwise equal result.
  A pair its planner cannot match (MoE: it finds experts by local name) gets null columns and
  ``mcore_error`` "megatron-core swap_model_weights: <its error>", and the next rows go on;
* ``time_step_plus_switch_sequential_s``: megatron optimizer step, then the switch (K=1);
  ``time_step_plus_switch_async_s``: the step overlapped with the switch in K segments
  (puzzle.switch.overlap); ``hidden_fraction`` = (sequential - async) / time_puzzle_s, the share
  of the switch hidden behind the step.

LoRA rows (``--only lora``, or ``all``): the same dense model with rank-``LORA.dim`` adapters on every
target linear, training (1, 2, 2) -> generation (1, 1, 4). The first switch lays the base and the
adapters out (``full_*``), every later one moves the adapters only (``adapters_*``): bytes moved
by the busiest rank (measured) against what it lacks, the median time of each switch, and
``adapter_over_full_bytes``. Generation on the merged copy against the unmerged one (adapters as
forward hooks, megatron's layer forward): ``decode_merged_ms_per_step`` /
``decode_unmerged_ms_per_step`` (greedy, taken in turns), and ``merge_unmerge_s``, what merging
costs per switch (puzzle/switch/lora_merge.py picks merged on these figures). The 7B row (LLaMA-2-7B
shape, bf16) is bytes only, from the routing plan: its weights are not moved (a 7B training copy
and its generation copy are about 27 GB in bf16, more than this machine's ranks should hold).

Times are wall times between barriers on rank 0 (so the slowest rank), median of ``--repeats``
after one warm-up. 4 processes share the machine's cores: expect noise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

PAIRS = [((4, 1, 1), (2, 1, 2)), ((2, 1, 2), (1, 1, 4)), ((1, 2, 2), (1, 1, 4)), ((2, 2, 1), (1, 2, 2))]
PAIRS = PAIRS + [(d, s) for s, d in PAIRS]
#: mixture of experts, (P, D, T, E) training layouts (T = 1) -> generation
#: layouts of another E
MOE_PAIRS = [((1, 4, 1, 4), (1, 4, 1, 1)), ((1, 4, 1, 2), (2, 2, 1, 1)), ((1, 4, 1, 2), (1, 1, 4, 1)),
             ((1, 4, 1, 4), (1, 2, 2, 2)), ((2, 2, 1, 2), (1, 4, 1, 4))]
WORLD = 4
MBS, SEQ = 1, 64


def _arch(moe: bool = False):
    from puzzle.config import ModelArch

    experts = dict(num_experts=4, moe_ffn_hidden_size=512, moe_router_topk=2) if moe else {}
    return ModelArch.llama(num_layers=4, hidden_size=256, ffn_hidden_size=512, num_attention_heads=8,
                           num_query_groups=4, vocab_size=1024, make_vocab_size_divisible_by=128, seq_length=SEQ,
                           untie_embeddings_and_output_weights=True, **experts)


def _plan(degrees):
    """(P, D, T) or (P, D, T, E) -> ParallelPlan."""
    from puzzle.parallel.plan import ParallelPlan

    return ParallelPlan(*degrees[:3], E=degrees[3] if len(degrees) > 3 else 1)


LORA_PAIR = ((1, 2, 2), (1, 1, 4))
LORA_DIM = 8
DECODE_ROWS, DECODE_TOKENS = 8, 16


def _lora():
    from puzzle.lora_config import LoRAConfig

    return LoRAConfig(dim=LORA_DIM, alpha=16.0)


def _arch_7b():
    from puzzle.config import ModelArch

    return ModelArch.llama(num_layers=32, hidden_size=4096, ffn_hidden_size=11008, num_attention_heads=32,
                           num_query_groups=32, vocab_size=32000, make_vocab_size_divisible_by=128, seq_length=4096)


def _cases(only: str):
    """(model kind, source plan, destination plan) of the run."""
    dense = [("dense", _plan(s), _plan(d)) for s, d in PAIRS] if only in ("all", "dense") else []
    moe = [("moe", _plan(s), _plan(d)) for s, d in MOE_PAIRS] if only in ("all", "moe") else []
    return dense + moe


def _timed(fn, repeats):
    import torch.distributed as dist

    times = []
    for i in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        if i:  # the first run is a warm-up
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _timed_alternately(first, second, repeats):
    """Medians of ``first`` and ``second`` run in turns (one warm-up turn), so both see the
    same machine load."""
    import torch.distributed as dist

    times = ([], [])
    for i in range(repeats + 1):
        for fn, out in zip((first, second), times):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            if i:
                out.append(time.perf_counter() - t0)
    return statistics.median(times[0]), statistics.median(times[1])


def _worker(args):
    from datetime import timedelta

    import megatron_patches

    megatron_patches.apply()
    import torch
    import torch.distributed as dist

    dist.init_process_group(backend="gloo", timeout=timedelta(seconds=args.timeout))
    from puzzle.parallel.groups import init_distributed, layout_for
    from puzzle.engine.model_engine import ModelEngine, OptimConfig

    rank, world = init_distributed()
    if args.only == "lora":
        rows = _lora_rows(args, world)
        if rank == 0:
            Path(args.out_file).write_text(json.dumps(rows))
        dist.barrier()
        dist.destroy_process_group()
        return
    cases = _cases(args.only)
    archs = {"dense": _arch(), "moe": _arch(moe=True)}
    for _, s, d in cases:  # every layout, collectively, in the same order
        layout_for(s)
        layout_for(d)
    engines = {}
    for kind, s, _ in cases:
        if (kind, s) not in engines:
            engines[(kind, s)] = ModelEngine("actor", archs[kind], layout_for(s), trainable=True, seed=5,
                                             optim=OptimConfig(lr=1e-4))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, archs["dense"].vocab_size, (4, SEQ), generator=g)
    rows = []
    for kind, src, dst in cases:
        rows.append(_switch_row(args, archs[kind], engines[(kind, src)], kind, src, dst, tokens, world))
        if rank == 0:
            print(f"[switch bench] {kind} {src} -> {dst} done", file=sys.stderr, flush=True)
    failed = _mcore_refit_columns(args, rows, cases, archs, engines, world)
    if args.only == "all" and not failed:
        rows.extend(_lora_rows(args, world))
    if rank == 0:
        Path(args.out_file).write_text(json.dumps(rows))
    if not failed:
        dist.barrier()
        dist.destroy_process_group()


def _switch_row(args, arch, eng, kind, src, dst, tokens, world) -> dict:
    """One case's row: the bytes puzzle's routing moves against the bounds, and its times."""
    import torch.distributed as dist

    from puzzle.models.param_names import table_params
    from puzzle.switch.routing_executor import execute_routing
    from puzzle.switch.shadow import build_shadow, routing_table_for, switch_to_generation
    from puzzle.dataflow.steps import lm_nll_step

    table = routing_table_for(arch, "actor", src, dst)
    shadow = build_shadow(arch, "actor", dst)
    src_params, dst_params = table_params(eng.module, "actor"), shadow.params()
    stats = []
    t_puzzle = _timed(lambda: stats.append(execute_routing(table, src_params, dst_params)), args.repeats)
    # gradients for the optimizer steps (kept across the timed steps: same work every step)
    share = tokens.shape[0] // src.D
    mine = tokens[eng.layout.d * share:(eng.layout.d + 1) * share]
    eng.model.zero_grad_buffer()
    eng.optimizer.zero_grad()
    eng.forward_backward(lm_nll_step(arch.vocab_size), iter(mine.split(MBS)), share // MBS, SEQ, MBS, forward_only=False)
    seq, asy = [], []
    for i in range(args.repeats + 1):  # interleaved, first pair is a warm-up
        for k, out in ((1, seq), (args.segments, asy)):
            dist.barrier()
            t0 = time.perf_counter()
            switch_to_generation(eng, dst, segments=k, shadow=shadow, optimizer_step=True)
            dist.barrier()
            if i:
                out.append(time.perf_counter() - t0)
    # plain optimizer step alone, for reference
    t_step = _timed(lambda: eng.optimizer.step(), args.repeats)
    recv = [None] * world
    dist.all_gather_object(recv, stats[-1].bytes_received)
    shadow.release()
    t_seq, t_asy = statistics.median(seq), statistics.median(asy)
    return {
        "model": kind, "src": str(src), "dst": str(dst),
        "bytes_moved_max_rank": max(recv),
        "lower_bound_bytes_max_rank": max(table.bytes_lacking(r) for r in range(world)),
        "allgather_bytes_max_rank": max(table.allgather_bytes(r) for r in range(world)),
        "model_bytes": table.model_bytes(),
        "time_puzzle_s": round(t_puzzle, 5),
        "time_optimizer_step_s": round(t_step, 5),
        "time_step_plus_switch_sequential_s": round(t_seq, 5),
        "time_step_plus_switch_async_s": round(t_asy, 5),
        "segments": args.segments,
        "hidden_fraction": round((t_seq - t_asy) / t_puzzle, 3) if t_puzzle > 0 else None,
    }


def _max_over_ranks(value, world) -> int:
    import torch.distributed as dist

    got = [None] * world
    dist.all_gather_object(got, value)
    return max(got)


def _lora_bytes_columns(arch, src, dst, dtype_bytes, world) -> dict:
    """Bytes of the full switch and of the adapters-only one, from the routing plan."""
    from puzzle.switch.lora_merge import adapter_bytes
    from puzzle.switch.shadow import routing_table_for

    full = routing_table_for(arch, "actor", src, dst, dtype_bytes, lora=_lora())
    adapters = routing_table_for(arch, "actor", src, dst, dtype_bytes, lora=_lora(), adapters_only=True)
    model = routing_table_for(arch, "actor", src, dst, dtype_bytes).model_bytes()
    return {"src": str(src), "dst": str(dst), "lora_dim": LORA_DIM, "dtype_bytes": dtype_bytes,
            "model_bytes": model, "adapter_bytes": adapter_bytes(arch, "actor", _lora(), dtype_bytes),
            "adapter_over_model_bytes": round(adapter_bytes(arch, "actor", _lora(), dtype_bytes) / model, 4),
            "full_lower_bound_bytes_max_rank": max(full.bytes_lacking(r) for r in range(world)),
            "adapters_lower_bound_bytes_max_rank": max(adapters.bytes_lacking(r) for r in range(world))}


def _lora_rows(args, world) -> list:
    """The LoRA rows: the bench's dense model (switched and generated) and the 7B (bytes only)."""
    import torch.distributed as dist

    from puzzle.bench.generation import _prompts
    from puzzle.engine.model_engine import ModelEngine, OptimConfig
    from puzzle.models.param_names import table_params
    from puzzle.parallel.groups import layout_for
    from puzzle.rollout import SamplingParams, generate
    from puzzle.switch.routing_executor import execute_routing
    from puzzle.switch.shadow import routing_table_for, switch_to_generation

    arch, (src, dst) = _arch(), (_plan(LORA_PAIR[0]), _plan(LORA_PAIR[1]))
    eng = ModelEngine("actor", arch, layout_for(src), trainable=True, seed=5, optim=OptimConfig(lr=1e-4), lora=_lora())
    row = {"model": "dense+lora", **_lora_bytes_columns(arch, src, dst, 4, world)}
    shadow = switch_to_generation(eng, dst)  # the first switch: base and adapters
    first = shadow.switch_stats.bytes_received
    src_params, dst_params = table_params(eng.module, "actor"), shadow.params()
    full = routing_table_for(arch, "actor", src, dst, 4, lora=_lora())
    adapters = routing_table_for(arch, "actor", src, dst, 4, lora=_lora(), adapters_only=True)
    stats = []
    t_full = _timed(lambda: execute_routing(full, src_params, dst_params), args.repeats)
    t_adapters = _timed(lambda: stats.append(execute_routing(adapters, src_params, dst_params)), args.repeats)
    # the unmerged copy: the same weights, adapters as forward hooks
    unmerged = ModelEngine("actor", arch, layout_for(dst), trainable=False, seed=5, lora=_lora())
    execute_routing(full, src_params, table_params(unmerged.module, "actor"))
    merged = SimpleNamespace(module=shadow.module, layout=shadow.layout, arch=arch, role="actor",
                             config=shadow.module.config, member=True)
    t_merge = _timed(lambda: (shadow.merge_adapters(), shadow.unmerge_adapters()), args.repeats)
    shadow.merge_adapters()
    prompts = _prompts(DECODE_ROWS, 8, 32, arch.vocab_size, seed=1)
    greedy = SamplingParams(DECODE_TOKENS, greedy=True)
    outs = {}
    t_m, t_u = _timed_alternately(lambda: outs.__setitem__("m", generate(merged, prompts, greedy, seed=0)),
                                  lambda: outs.__setitem__("u", generate(unmerged, prompts, greedy, seed=0)),
                                  max(1, args.repeats // 3))
    shadow.release()
    row.update(full_bytes_moved_max_rank=_max_over_ranks(first, world),
               adapters_bytes_moved_max_rank=_max_over_ranks(stats[-1].bytes_received, world),
               time_full_switch_s=round(t_full, 5), time_adapters_switch_s=round(t_adapters, 5),
               merge_unmerge_s=round(t_merge, 5), decode_rows=DECODE_ROWS,
               decode_merged_ms_per_step=round(t_m / DECODE_TOKENS * 1e3, 3),
               decode_unmerged_ms_per_step=round(t_u / DECODE_TOKENS * 1e3, 3),
               decode_greedy_tokens_equal=outs["m"].responses() == outs["u"].responses())
    row["adapter_over_full_bytes"] = round(row["adapters_bytes_moved_max_rank"] / row["full_bytes_moved_max_rank"], 4)
    big = {"model": "7B+lora (LLaMA-2-7B shape, bf16)", **_lora_bytes_columns(_arch_7b(), src, dst, 2, world),
           "note": "bytes computed by the routing plan; weights not moved (too large for this machine's ranks)"}
    big["adapter_over_full_bytes"] = round(big["adapters_lower_bound_bytes_max_rank"]
                                           / big["full_lower_bound_bytes_max_rank"], 4)
    dist.barrier()
    return [row, big]


def _mcore_unmatched(src_module, dst_module):
    """The error megatron-core's refit planner raises for this pair, or None (collective).

    Its planner matches every destination parameter to a source parameter by a resolved name
    (global layer index; expert index for grouped-GEMM weights only), on rank 0 alone, and
    raises there while the other ranks wait for the plan: they would hang until the
    process-group timeout and leave the group unusable. So every rank runs the same name match
    first, on names from megatron's own metadata functions, and all skip the call together."""
    import torch.distributed as dist
    from megatron.core.resharding.utils import _build_layer_module_prefix_map, extract_param_metadata
    from megatron.core.utils import unwrap_model

    rank, world = dist.get_rank(), dist.get_world_size()
    names = []
    for module in (src_module, dst_module):
        core = unwrap_model(module)
        prefixes = _build_layer_module_prefix_map(core)
        names.append([extract_param_metadata(p, n, rank, core.pg_collection, num_experts=core.config.num_moe_experts,
                                             layer_module_prefix_map=prefixes).resolved_name
                      for n, p in core.named_parameters()])
    gathered = [None] * world
    dist.all_gather_object(gathered, names)
    src_names = {n for src, _ in gathered for n in src}
    for dst_rank, (_, dst) in enumerate(gathered):
        for n in dst:
            if n not in src_names:
                return f"RuntimeError: Destination parameter '{n}' on rank {dst_rank} not found in source model."
    return None


def _mcore_refit_columns(args, rows, cases, archs, engines, world):
    """megatron-core's refit (swap_model_weights) of every case, last, timed alternately with
    puzzle's switch of the same case (so both see the same machine load): ``time_mcore_refit_s``,
    ``time_puzzle_alongside_mcore_s`` and their ratio ``puzzle_vs_mcore_refit``. A pair its planner
    cannot match gets null columns and the reason in ``mcore_error``, and the next rows go on; any
    other failure may leave the process group unusable, so the cases after it are skipped.
    Returns that failure or None."""
    import torch
    import torch.distributed as dist
    from megatron.core.resharding import swap_model_weights

    from puzzle.models.param_names import table_params
    from puzzle.switch.routing_executor import execute_routing
    from puzzle.switch.shadow import build_shadow, routing_table_for

    failed = None
    for row, (kind, src, dst) in zip(rows, cases):
        arch = archs[kind]
        row.update(time_mcore_refit_s=None, time_mcore_first_s=None, time_puzzle_alongside_mcore_s=None,
                   puzzle_vs_mcore_refit=None, mcore_matches_puzzle=None, mcore_error=None)
        if failed:
            row["mcore_error"] = f"skipped after an earlier failure: {failed}"
            continue
        eng = engines[(kind, src)]
        shadow = build_shadow(arch, "actor", dst)
        unmatched = _mcore_unmatched(eng.module, shadow.module)
        if unmatched:
            row["mcore_error"] = f"megatron-core swap_model_weights: {unmatched}"
            shadow.release()
            continue
        table = routing_table_for(arch, "actor", src, dst)
        src_params, dst_params = table_params(eng.module, "actor"), shadow.params()
        try:
            dist.barrier()
            t0 = time.perf_counter()
            swap_model_weights(eng.module, shadow.module, "gloo")
            dist.barrier()
            row["time_mcore_first_s"] = round(time.perf_counter() - t0, 5)
            t_puzzle, t_mcore = _timed_alternately(lambda: execute_routing(table, src_params, dst_params),
                                                   lambda: swap_model_weights(eng.module, shadow.module, "gloo"),
                                                   args.repeats)
            row.update(time_mcore_refit_s=round(t_mcore, 5), time_puzzle_alongside_mcore_s=round(t_puzzle, 5),
                       puzzle_vs_mcore_refit=round(t_puzzle / t_mcore, 3))
            mc = {k: v.clone() for k, v in dst_params.items()}
            execute_routing(table, src_params, dst_params)
            same = all(torch.equal(mc[k], v) for k, v in dst_params.items())
            flags = [None] * world
            dist.all_gather_object(flags, same)
            row["mcore_matches_puzzle"] = all(flags)
            if not all(flags):  # e.g. MoE at E -> E': it pairs experts by their local index
                row["mcore_error"] = ("megatron-core swap_model_weights ran, but its weights differ from puzzle's "
                                      "(and from the model built at the destination): its time is no baseline")
        except Exception as exc:  # noqa: BLE001 - reported in the row
            failed = f"{type(exc).__name__}: {exc}"[:300]
            row["mcore_error"] = f"megatron-core swap_model_weights: {failed}"
            traceback.print_exc()
        shadow.release()
    return failed


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--segments", type=int, default=8)
    ap.add_argument("--only", choices=("all", "dense", "moe", "lora"), default="all",
                    help="the dense model's plan pairs, the MoE model's (P, D, T, E) pairs, the LoRA rows, or all")
    ap.add_argument("--timeout", type=int, default=180, help="process-group timeout (s): guards a hang")
    ap.add_argument("--out", default=None, help="also write the rows to this JSON file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out-file", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return _worker(args)
    repo = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory(prefix="puzzle-bench-switch-") as tmp:
        out_file = str(Path(tmp) / "rows.json")
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   PYTHONPATH=f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
               "-m", "puzzle.bench.switch", "--worker", "--out-file", out_file,
               "--repeats", str(args.repeats), "--segments", str(args.segments), "--timeout", str(args.timeout),
               "--only", args.only]
        proc = subprocess.run(cmd, env=env, cwd=repo, capture_output=True, text=True,
                              timeout=args.timeout * 4 + 1200)
        if not Path(out_file).exists():
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
            raise SystemExit(f"benchmark world failed (rc={proc.returncode})")
        rows = json.loads(Path(out_file).read_text())
    for row in rows:
        print(json.dumps(row))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
