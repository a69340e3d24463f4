"""Benchmark: where the time of one decode step goes (GPU; runs on CPU too, without graphs).

    torchrun --standalone --nproc-per-node 1 -m puzzle.bench.decode_step [--batch 64]
        [--new-tokens 64] [--model 1b|tiny] [--trace DIR] [--num-experts E [--moe-router-topk K]]

One rank, (P, D, T) = (1, 1, 1), the actor of ``puzzle.bench.generation``'s model, greedy and
sampled decoding. Prints one JSON object, milliseconds per decode step unless named otherwise:

- ``generate_ms_per_step``: a whole ``generate()`` call (prefill included) over its steps;
- ``prefill_ms``: a ``generate()`` of one new token (the prefill, not per step);
- ``replay_ms``: the captured whole decode step (model, sampling, state update) replayed alone
  (GPU; ``--compile``: through torch.compile);
- ``sample_greedy_ms`` / ``sample_ms``: ``sample_tokens`` on the step's logits;
- ``weight_read_ms``: the weights and KV cache a step must read, over the measured bandwidth:
  the memory bound of one step; ``graph_decode_efficiency``: that bound over ``replay_ms``, the
  figure a device profile's ``hardware.graph_decode_efficiency`` takes for the plan search.

``--num-experts E``: every MLP a MoE layer of E experts (top-K, each expert's hidden size the
dense one over K). On a GPU the graphed steps then run the static MoE step
(puzzle/models/moe_decode.py); on a CPU ``static_moe_greedy_ms_per_step`` times that step without
capture against the eager loop's megatron MoE forward (``static_over_eager``).

With ``--trace DIR`` also a torch.profiler table of one generate() call (top CPU and device
operators) in DIR/profile.txt and its chrome trace.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace


def _ms(fn, repeats, dev):
    import torch

    fn()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return (time.perf_counter() - t0) / repeats * 1e3


def _write_trace(run, directory: str, dev) -> None:
    """torch.profiler of one ``run()``: its kernel tables (profile.txt) and a Chrome trace."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = dev.type == "cuda"
    os.makedirs(directory, exist_ok=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        run()
        if cuda:
            torch.cuda.synchronize(dev)
    ka = prof.key_averages()
    with open(os.path.join(directory, "profile.txt"), "w") as f:
        f.write(ka.table(sort_by="self_cpu_time_total", row_limit=45))
        if cuda:
            f.write("\n\n")
            f.write(ka.table(sort_by="self_device_time_total", row_limit=45))
    prof.export_chrome_trace(os.path.join(directory, "trace.json"))


def _memory_bound(eng, arch, prompts, n_new, row, dev) -> dict:
    """The bytes a decode step must read over the measured bandwidth, against the measured step
    times in ``row``; ``graph_decode_efficiency`` is the device profile's
    hardware.graph_decode_efficiency (the cost model's graphed decode step)."""
    from puzzle.bench.generation import _decode_bytes
    from puzzle.bench.gpu_report import measure_bandwidth

    bw = measure_bandwidth(dev)
    read_ms = round(_decode_bytes(eng.module, arch, prompts, n_new, 2, 1) / (n_new - 1) / bw * 1e3, 3)
    return {"bandwidth_GBps": round(bw / 1e9, 1), "weight_read_ms": read_ms,
            "bound_over_greedy_step": round(read_ms / row["generate_greedy_ms_per_step"], 3),
            "graph_decode_efficiency": round(min(read_ms / row["replay_ms"], 1.0), 3)}


def _static_moe_on_cpu(eng, prompts, params, reps, dev, eager_ms) -> dict:
    """The graph path's decode steps without capture (static MoE step, no HostSyncGuard) against
    the eager loop (megatron's MoE forward), and whether both give the same greedy tokens."""
    from puzzle.rollout import generate
    from puzzle.rollout.cuda_graphs import DecodeGraphs

    eng.module._puzzle_decode_graphs = DecodeGraphs(dev, capture=False, host_sync_guard=False)
    try:
        static = lambda: generate(eng, prompts, params, seed=0, cuda_graphs=True)  # noqa: E731
        ms = _ms(static, reps, dev) / params.max_new_tokens
        same = static().responses() == generate(eng, prompts, params, seed=0).responses()
    finally:
        del eng.module._puzzle_decode_graphs
    return {"static_moe_greedy_ms_per_step": round(ms, 3), "static_over_eager": round(ms / eager_ms, 3),
            "static_moe_greedy_tokens_equal_eager": same}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--model", choices=["tiny", "1b"], default=None)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--trace", default=None)
    ap.add_argument("--compile", action="store_true", help="torch.compile the captured decode step")
    ap.add_argument("--num-experts", type=int, default=None, help="MoE layers of this many experts")
    ap.add_argument("--moe-router-topk", type=int, default=2)
    args = ap.parse_args(argv)

    from puzzle.bench.generation import _prompts, start_one_rank_bench, with_experts

    dev, model_name, arch = start_one_rank_bench(args.model)
    import torch

    from puzzle.parallel.groups import layout_for
    from puzzle.parallel.plan import ParallelPlan
    from puzzle.rollout import SamplingParams, generate
    from puzzle.rollout.sampling import sample_tokens
    from puzzle.engine.model_engine import ModelEngine

    cuda = dev.type == "cuda"
    if args.num_experts:
        arch = with_experts(arch, args.num_experts, args.moe_router_topk)
    eng = ModelEngine("actor", replace(arch, attention_backend="local"), layout_for(ParallelPlan(1, 1, 1)),
                      trainable=False, seed=7, bf16=cuda)
    b, n_new = args.batch, args.new_tokens
    lo, hi = (16, 128) if model_name == "1b" else (8, 32)
    prompts = _prompts(b, lo, hi, arch.vocab_size, seed=b)
    greedy = SamplingParams(n_new, greedy=True)
    sampled = SamplingParams(n_new, temperature=0.7)
    row = {"model": model_name, "device": str(torch.cuda.get_device_name() if cuda else "cpu"),
           "batch": b, "new_tokens": n_new, "cuda_graphs": cuda}
    if args.num_experts:
        row.update(num_experts=args.num_experts, moe_router_topk=args.moe_router_topk)

    if args.compile:  # the first call compiles and captures
        t0 = time.perf_counter()
        generate(eng, prompts, greedy, seed=0, cuda_graphs=cuda, compile_graphs=True)
        row["compile"], row["first_generate_s"] = True, round(time.perf_counter() - t0, 1)

    def gen(params):
        return generate(eng, prompts, params, seed=0, cuda_graphs=cuda, compile_graphs=args.compile)

    reps = max(2, args.repeats // 10)
    one = SamplingParams(1, greedy=True)  # the prefill and its sampling only
    row["prefill_ms"] = round(_ms(lambda: generate(eng, prompts, one, seed=0), reps, dev), 3)
    row["generate_greedy_ms_per_step"] = round(_ms(lambda: gen(greedy), reps, dev) / n_new, 3)
    row["generate_sampled_ms_per_step"] = round(_ms(lambda: gen(sampled), reps, dev) / n_new, 3)
    if args.num_experts and not cuda:
        row.update(_static_moe_on_cpu(eng, prompts, greedy, reps, dev, row["generate_greedy_ms_per_step"]))
    if cuda:  # greedy rows equal to the eager loop's (bf16: a fused kernel may round differently)
        a = gen(greedy).responses()
        e = generate(eng, prompts, greedy, seed=0).responses()
        row["greedy_rows_equal_eager"] = round(sum(x == y for x, y in zip(a, e)) / b, 3)
        fused = list(eng.module._puzzle_decode_graphs.fused.values())
        row["replay_ms"] = round(min(_ms(f.graph.replay, args.repeats * 5, dev) for f in fused), 3)
    logits = torch.randn(b, eng.module.output_layer.weight.shape[0], device=dev,
                         dtype=torch.bfloat16 if cuda else torch.float32)
    ids = torch.arange(b, device=dev)
    step = torch.zeros(b, dtype=torch.long, device=dev)
    for name, params in (("sample_greedy_ms", greedy), ("sample_ms", sampled)):
        row[name] = round(_ms(lambda: sample_tokens(logits, params, true_vocab=arch.vocab_size, seed=0,
                                                    sample_ids=ids, step=step), args.repeats * 5, dev), 3)
    if cuda:
        row.update(_memory_bound(eng, arch, prompts, n_new, row, dev))
    if args.trace:
        _write_trace(lambda: gen(sampled), args.trace, dev)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
