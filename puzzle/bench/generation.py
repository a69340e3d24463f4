"""Benchmark: puzzle's generate() against transformers' generate() on the same weights.

    python -m puzzle.bench.generation [--batches 4,32,128] [--new-tokens 64] [--repeats 3]
                                      [--model tiny|1b] [--no-tp] [--out rows.json]

Spawns its own torchrun worlds: one rank at (P, D, T) = (1, 1, 1), then two ranks at (1, 1, 2)
(skipped with ``--no-tp``, or on a GPU machine with fewer than 2 GPUs). Per batch size, with
ragged prompts and greedy decoding of ``--new-tokens`` tokens (no EOS), one JSON row per
(layout, batch): ``hf_tokens_per_s`` (LlamaForCausalLM built from puzzle's weights through the
HF mapping, its own ``generate()`` with left padding, on rank 0), ``puzzle_<backend>_tokens_per_s``
for the SDPA (``local``) and megatron unfused backends, their ratios to transformers, and
``tokens_equal`` (asserted on CPU, float32). Times are medians of ``--repeats`` after a warm-up,
taken in turn in the same run. On CPU also ``puzzle_local_invariant`` (the SDPA backend in
``--batch-invariant-mode``, puzzle/models/batch_invariant.py; its greedy tokens are reported, not
asserted: its rounding is its own) and ``invariant_over_default`` (its tokens/s over the default
``local``'s): what bitwise generation-vs-scoring parity costs.

On a CUDA device (bf16; ``--model 1b`` is a 1.1B LLaMA shape): also ``puzzle_local_graphs``
(``--cuda-graph-generation``) and ``puzzle_compiled_graphs`` (with ``--compile-generation``, a
second copy of the model with its own graphs; ``rows_equal_compiled_eager``: the fraction of rows
whose greedy tokens equal the eager kernels'), the measured device memory bandwidth (a large device-to-device
copy, read + write bytes / time) and ``decode_bound_ratio`` = (weight bytes + KV bytes read per
decode step, summed over the steps) / bandwidth / measured generation time: 1.0 is the memory
bound. Without a GPU, that figure is not produced.

A ``stages`` row: the tiny PPO run's model (2 layers, hidden 64) at its scoring and training
shapes through megatron's schedule, seconds per call for the SDPA and unfused backends and
``unfused / sdpa`` ratios (> 1: SDPA is faster).
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
from dataclasses import replace
from pathlib import Path


def _arch(model: str):
    from puzzle.config import ModelArch

    if model == "1b":  # TinyLlama-1.1B's shape
        return ModelArch.llama(num_layers=22, hidden_size=2048, ffn_hidden_size=5632, num_attention_heads=32,
                               num_query_groups=4, vocab_size=32000, seq_length=1024,
                               untie_embeddings_and_output_weights=True, add_bias_linear=False)
    return ModelArch.llama(num_layers=4, hidden_size=256, ffn_hidden_size=1024, num_attention_heads=8,
                           num_query_groups=4, vocab_size=1024, seq_length=256,
                           untie_embeddings_and_output_weights=True, add_bias_linear=False)


def start_one_rank_bench(model):
    """megatron's patches applied, the torchrun world started, then (this rank's device, the
    model name ``model`` or by default 1b on CUDA and tiny elsewhere, its ModelArch)."""
    import megatron_patches

    megatron_patches.apply()
    from puzzle.parallel.device import runtime
    from puzzle.parallel.groups import init_distributed

    init_distributed()
    dev = runtime().device
    name = model or ("1b" if dev.type == "cuda" else "tiny")
    return dev, name, _arch(name)


def with_experts(arch, num_experts: int, topk: int, **changes):
    """``arch`` with every MLP a MoE layer of ``num_experts`` experts, top-``topk``, each expert's
    hidden size the dense one over ``topk`` (the same active width)."""
    from dataclasses import replace

    return replace(arch, num_experts=num_experts, moe_router_topk=topk,
                   moe_ffn_hidden_size=arch.ffn_hidden_size // topk, **changes)


def _sync(dev):
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _once(fn, dev):
    """(seconds between barriers, result) of one call on every rank."""
    import torch.distributed as dist

    dist.barrier()
    _sync(dev)
    t0 = time.perf_counter()
    out = fn()
    _sync(dev)
    dist.barrier()
    return time.perf_counter() - t0, out


def _timed(fn, repeats, dev):
    """Median seconds of ``repeats`` calls after a warm-up call."""
    _once(fn, dev)
    return statistics.median(_once(fn, dev)[0] for _ in range(repeats))


def _prompts(b, lo, hi, vocab, seed):
    import torch

    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (b,), generator=g)
    return [torch.randint(1, vocab, (int(n),), generator=g).tolist() for n in lens]


def _hf_model(full, arch, dev, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    from puzzle.models.hf_checkpoint import hf_tensors_from_full
    from puzzle.models.hf_mapping import hf_config_from_arch

    cfg = hf_config_from_arch(arch)
    for k in ("architectures", "dtype", "torch_dtype", "rope_scaling"):
        cfg.pop(k, None)
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    model.load_state_dict(hf_tensors_from_full(full, arch, "actor"), strict=True)
    return model.to(device=dev, dtype=dtype).eval()


def _hf_generate(model, prompts, n_new, dev):
    import torch

    lp = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), lp, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, lp - len(p):] = torch.tensor(p)
        mask[i, lp - len(p):] = 1
    with torch.no_grad():
        out = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=n_new,
                             min_new_tokens=n_new, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[:, lp:].cpu()


def _decode_bytes(model, arch, prompts, n_new, elem_bytes: int, T: int) -> float:
    """Bytes one rank must read over the decode steps: its weights once per step (not the input
    embedding table, of which a step reads b rows) plus each row's keys and values so far."""
    emb = 0
    for name, p in model.named_parameters():
        if name.endswith("embedding.word_embeddings.weight") and arch.untie_embeddings_and_output_weights:
            emb += p.numel() * p.element_size()
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) - emb
    kv_per_token = arch.num_layers * arch.shape.kv_bytes_per_token(T, elem_bytes)
    steps = n_new - 1  # the first token comes from the prefill
    kv = sum(kv_per_token * sum(len(p) + s for p in prompts) for s in range(1, steps + 1))
    return steps * weights + kv


def _stage_ratios(repeats, dev):
    """Scoring (forward-only) and training (forward + backward) of the tiny run's model."""
    import torch

    from puzzle.bench.calibration import tiny_arch
    from puzzle.parallel.groups import layout_for
    from puzzle.parallel.plan import ParallelPlan
    from puzzle.engine.model_engine import ModelEngine, OptimConfig
    from puzzle.dataflow.steps import lm_nll_step

    arch = tiny_arch()
    batch, seq, mbs = 16, 48, 2
    tokens = torch.randint(0, arch.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    tokens = tokens.to(dev)
    row = {"layout": "(P=1, D=1, T=1)", "kind": "stages", "model": "tiny-run (2 layers, hidden 64)",
           "batch": batch, "seq": seq, "micro_batch_size": mbs}
    for be in ("local", "unfused"):
        eng = ModelEngine("actor", replace(arch, attention_backend=be), layout_for(ParallelPlan(1, 1, 1)),
                          trainable=True, seed=3, optim=OptimConfig(lr=1e-4))

        def run(forward_only):
            if not forward_only:
                eng.zero_grad()
            eng.forward_backward(lm_nll_step(arch.vocab_size), iter(tokens.split(mbs)), batch // mbs,
                                 seq, mbs, forward_only=forward_only)

        name = "sdpa" if be == "local" else be
        row[f"score_{name}_s"] = round(_timed(lambda: run(True), repeats, dev), 5)
        row[f"train_{name}_s"] = round(_timed(lambda: run(False), repeats, dev), 5)
    row["score_unfused_over_sdpa"] = round(row["score_unfused_s"] / row["score_sdpa_s"], 3)
    row["train_unfused_over_sdpa"] = round(row["train_unfused_s"] / row["train_sdpa_s"], 3)
    return row


def _worker(args):
    import megatron_patches

    megatron_patches.apply()
    import torch
    import torch.distributed as dist

    from puzzle.models.hf_checkpoint import gather_full_state
    from puzzle.parallel.groups import init_distributed, layout_for
    from puzzle.parallel.plan import ParallelPlan
    from puzzle.rollout import SamplingParams
    from puzzle.engine.model_engine import ModelEngine

    from puzzle.parallel.device import runtime

    rank, world = init_distributed()
    dev = runtime().device
    cuda = dev.type == "cuda"
    arch = _arch(args.model)
    plan = ParallelPlan(1, 1, world)
    layout = layout_for(plan)
    backends = ["local"] if cuda else ["local", "unfused"]
    engines = {be: ModelEngine("actor", replace(arch, attention_backend=be), layout, trainable=False,
                               seed=7, bf16=cuda) for be in backends}
    if cuda:
        engines["compiled"] = ModelEngine("actor", replace(arch, attention_backend="local"), layout,
                                          trainable=False, seed=7, bf16=True)
    full = gather_full_state(engines["local"].module, arch, "actor")
    hf = _hf_model(full, arch, dev, torch.bfloat16 if cuda else torch.float32) if rank == 0 else None
    from puzzle.bench.gpu_report import measure_bandwidth

    bw = measure_bandwidth(dev) if cuda else None
    n_new = args.new_tokens
    params = SamplingParams(n_new, greedy=True)
    lo, hi = (16, 128) if args.model == "1b" else (8, 32)
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        prompts = _prompts(b, lo, hi, arch.vocab_size, seed=b)
        row = {"layout": str(plan), "kind": "generate", "model": args.model, "device": str(dev),
               "dtype": "bfloat16" if cuda else "float32", "batch": b, "new_tokens": n_new,
               "prompt_lengths": [lo, hi]}
        times, toks = _time_variants(args, engines, backends, hf, prompts, params, dev, cuda)
        if rank == 0:
            _fill_row(row, times, toks, engines, arch, prompts, n_new, world, bw)
            rows.append(row)
    if world == 1 and args.stages:
        stages = _stage_ratios(args.repeats, dev)
        if rank == 0:
            rows.append(stages)
    if rank == 0:
        Path(args.worker_out).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def _time_variants(args, engines, backends, hf, prompts, params, dev, cuda):
    """Each puzzle variant's and transformers' generation times over ``args.repeats`` rounds (in
    turn, after a warm-up round) and their tokens (transformers' on rank 0 only)."""
    import torch
    import torch.distributed as dist

    from puzzle.rollout import generate

    toks, times = {}, {}
    variants = [(be, False, False, False) for be in backends]
    if cuda:  # CUDA graphs; then through torch.compile (a second model: its own graphs)
        variants += [("local", True, False, False), ("compiled", True, True, False)]
    else:  # --batch-invariant-mode (CPU only)
        variants += [("local", False, False, True)]
    rank = dist.get_rank()
    for i in range(args.repeats + 1):  # in turn: warm-up pass first
        for be, graphs, compiled, invariant in variants:
            name = be + ("_graphs" if graphs else "") + ("_invariant" if invariant else "")
            t, out = _once(lambda: generate(engines[be], prompts, params, seed=0, cuda_graphs=graphs,
                                            compile_graphs=compiled, batch_invariant=invariant), dev)
            toks[name] = torch.tensor([r for r in out.responses()])
            if i:
                times.setdefault(name, []).append(t)
        dist.barrier()
        if rank == 0:
            _sync(dev)
            t0 = time.perf_counter()
            toks["hf"] = _hf_generate(hf, prompts, params.max_new_tokens, dev)
            _sync(dev)
            if i:
                times.setdefault("hf", []).append(time.perf_counter() - t0)
        dist.barrier()
    return times, toks


def _fill_row(row, times, toks, engines, arch, prompts, n_new, world, bw) -> None:
    """Tokens per second against transformers', token equality and (CUDA) the decode-bound
    fractions; on CPU, greedy tokens that differ from transformers' raise."""
    import torch

    b = len(prompts)
    hf_tps = b * n_new / statistics.median(times["hf"])
    row["hf_tokens_per_s"] = round(hf_tps, 1)
    for name, ts in times.items():
        if name == "hf":
            continue
        tps = b * n_new / statistics.median(ts)
        row[f"puzzle_{name}_tokens_per_s"] = round(tps, 1)
        row[f"puzzle_{name}_over_hf"] = round(tps / hf_tps, 3)
        row[f"tokens_equal_{name}"] = bool(torch.equal(toks[name], toks["hf"]))
    if "local_invariant" in times:
        row["invariant_over_default"] = round(row["puzzle_local_invariant_tokens_per_s"]
                                              / row["puzzle_local_tokens_per_s"], 3)
    if "local_graphs" in toks:  # CUDA graphs against the same loop run eagerly
        row["tokens_equal_graphs_eager"] = bool(torch.equal(toks["local_graphs"], toks["local"]))
        row["graph_captures"] = engines["local"].module._puzzle_decode_graphs.captures
        same = (toks["compiled_graphs"] == toks["local"]).all(dim=1)
        row["rows_equal_compiled_eager"] = round(float(same.float().mean()), 3)
    if bw is not None:
        need = _decode_bytes(engines["local"].module, arch, prompts, n_new, 2, world)
        row["bandwidth_GBps"] = round(bw / 1e9, 1)
        row["decode_bytes_per_rank"] = int(need)
        for name in ("local", "local_graphs", "compiled_graphs"):
            row[f"decode_bound_ratio_{name}"] = round(need / bw / statistics.median(times[name]), 3)
    elif not all(row[f"tokens_equal_{n}"] for n in times if n not in ("hf", "local_invariant")):
        raise AssertionError(f"greedy tokens differ from transformers at batch {b}: {row}")


def _spawn(nproc: int, args) -> list:
    with tempfile.TemporaryDirectory(prefix="puzzle-bench-gen-") as tmp:
        out = os.path.join(tmp, "rows.json")
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "puzzle.bench.generation", "--worker-out", out, "--batches", args.batches,
               "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats), "--model", args.model]
        if nproc == 1 and not args.no_stages:
            cmd.append("--stages")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not os.path.exists(out):
            tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-40:])
            raise RuntimeError(f"benchmark world of {nproc} failed:\n{tail}")
        return json.loads(Path(out).read_text())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (CPU: 4,32,128; GPU: 64)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", choices=["tiny", "1b"], default=None,
                    help="tiny: 4 layers, hidden 256, GQA 8/4, vocab 1024 (CPU default); 1b: 1.1B LLaMA (GPU default)")
    ap.add_argument("--no-tp", action="store_true", help="skip the TP=2 world")
    ap.add_argument("--no-stages", action="store_true", help="skip the scoring/training stage ratios")
    ap.add_argument("--out", default=None, help="also write the rows to this JSON file")
    ap.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--stages", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    import torch

    gpu = torch.cuda.is_available()
    args.model = args.model or ("1b" if gpu else "tiny")
    args.batches = args.batches or ("64" if gpu else "4,32,128")
    if args.worker_out:
        return _worker(args)
    rows = _spawn(1, args)
    if not args.no_tp and (not gpu or torch.cuda.device_count() >= 2):
        rows += _spawn(2, replace_ns(args, no_stages=True))
    for r in rows:
        print(json.dumps(r))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


def replace_ns(ns, **kw):
    d = dict(vars(ns))
    d.update(kw)
    return argparse.Namespace(**d)


if __name__ == "__main__":
    main()
