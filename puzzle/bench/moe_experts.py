"""Benchmark: grouped-GEMM experts (``--moe-grouped-gemm``) against megatron's SequentialMLP.

    torchrun --standalone --nproc-per-node 1 -m puzzle.bench.moe_experts [--model 1b|tiny]
        [--num-experts 8] [--moe-router-topk 2] [--tokens 4096] [--num-layers 8] [--repeats 5]

One rank, (P, D, T, E) = (1, 1, 1, 1), the model of ``puzzle.bench.generation`` with every MLP a
MoE layer (each expert's hidden size the dense one over top-k; bf16 on CUDA, fp32 on CPU) and
``--num-layers`` layers (default: 8 of the 1b shape, so that two trainable copies fit one GPU). The
two actors have the same weights (same seed); each runs the same forward and backward of one
micro-batch of ``--tokens`` tokens (scoring: forward only, training: forward and backward), the
two alternating in each repeat. Prints one JSON object: milliseconds per call (the median of
the repeats), ``grouped_over_sequential`` time ratios measured in this run (below 1: grouped
faster), and ``logprobs_max_diff`` between the two forwards (0 on CPU, where torch's grouped
product is one product per group).
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["tiny", "1b"], default=None)
    ap.add_argument("--num-experts", type=int, default=8)
    ap.add_argument("--moe-router-topk", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=None, help="tokens per micro-batch (default 4096, CPU 512)")
    ap.add_argument("--num-layers", type=int, default=None, help="layers (default: 8 for 1b, the model's for tiny)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)

    from puzzle.bench.generation import _once, start_one_rank_bench, with_experts

    dev, model_name, arch = start_one_rank_bench(args.model)
    import torch

    from puzzle.parallel.groups import layout_for
    from puzzle.parallel.plan import ParallelPlan
    from puzzle.engine.model_engine import ModelEngine, OptimConfig
    from puzzle.dataflow.steps import lm_nll_step

    cuda = dev.type == "cuda"
    k = args.moe_router_topk
    layers = args.num_layers or (8 if model_name == "1b" else arch.num_layers)
    arch = with_experts(arch, args.num_experts, k, attention_backend="local", num_layers=layers)
    tokens = args.tokens or (4096 if cuda else 512)
    seq = min(tokens, arch.seq_length)
    batch = torch.randint(0, arch.vocab_size, (tokens // seq, seq), generator=torch.Generator().manual_seed(3))
    engines = {name: ModelEngine("actor", replace(arch, moe_grouped_gemm=grouped), layout_for(ParallelPlan(1, 1, 1)),
                                 trainable=True, seed=7, bf16=cuda, optim=OptimConfig(lr=0.0))
               for name, grouped in (("sequential", False), ("grouped", True))}
    stores = {name: [] for name in engines}

    def run(name, forward_only):
        eng = engines[name]
        eng.zero_grad()
        store = stores[name] if forward_only else None
        eng.forward_backward(lm_nll_step(arch.vocab_size, store), iter([batch.to(dev)]), 1, seq, batch.shape[0],
                             forward_only=forward_only)

    row = {"model": model_name, "device": torch.cuda.get_device_name() if cuda else "cpu",
           "num_layers": layers, "num_experts": args.num_experts, "moe_router_topk": k, "tokens": batch.numel(),
           "bf16": cuda}
    for stage, forward_only in (("scoring", True), ("training", False)):
        times = {name: [] for name in engines}
        for rep in range(args.repeats + 1):  # the first repeat warms up
            order = list(engines) if rep % 2 == 0 else list(engines)[::-1]
            for name in order:
                ms = _once(lambda: run(name, forward_only), dev)[0] * 1e3
                if rep:
                    times[name].append(ms)
        for name in engines:
            row[f"{stage}_{name}_ms"] = round(statistics.median(times[name]), 3)
        row[f"{stage}_grouped_over_sequential"] = round(row[f"{stage}_grouped_ms"] / row[f"{stage}_sequential_ms"], 3)
    a, b = stores["grouped"][-1], stores["sequential"][-1]
    row["logprobs_max_diff"] = float((a.float() - b.float()).abs().max())
    print(json.dumps(row))


if __name__ == "__main__":
    main()
