"""Benchmark: trained samples/s of a tiny GRPO run, synchronous against --rl-partial-rollouts.

    python -m puzzle.bench.long_tail [--iterations 6] [--max-new-tokens 192] [--n-samples 4] [--oversample 2] [--out rows.json]

In ONE run (one 1-rank torchrun world), the tiny GRPO model of examples/run_grpo_tiny.sh (random
weights) trains with whole iterations (generation, rewards, scoring, training) on two
response-length distributions: ``long_tailed`` (``puzzle.bench.packing.response_lengths``'
exponential, mean/max ~0.16 of --max-new-tokens, the same draw, without its row forced to the
cap) and ``all_equal`` (every response at the cap). A random model has no length distribution of
its own, so the lengths are planted: each sample's end-of-sequence token is made the argmax
once its response reaches the length drawn for its (seed, sample index), and is never sampled
before; the log-probs recorded are the model's. Both modes' trainers live in the one world:
one warm-up iteration each, then ``--iterations`` timed ones alternating between the modes (load
from other processes falls on both); samples/s = trained samples / the summed wall time of a
mode's timed iterations. The JSON rows carry each mode's samples/s, generation seconds per
iteration and trained response lengths, and per distribution ``ratio_partial_over_sync``.

Read with the lengths: in a short run the partial mode trains shorter responses on average than
were drawn (the long ones are still carried), which makes its scoring and training cheaper; and
with equal lengths every served group finishes at once, so the groups beyond the quota are
carried finished and the next iteration generates nothing (two batches per generation).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
         "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--tokenizer-type", "ByteLevelTokenizer",
         "--init-random", "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1"]
RUN = ["--advantage-estimator", "grpo", "--rollout-batch-size", "16",
       "--micro-batch-size", "32", "--lr", "3e-3", "--seed", "1234", "--temperature", "1.0", "--kl-coef", "0",
       "--prompt-data", "puzzle/data/bundled/tiny_arithmetic.jsonl",
       "--reward-fn", "puzzle.reward_functions.builtin:lowercase_fraction", "--reward-timeout", "0",
       "--rl-inference-logprobs-is-correction", "--log-interval", "1000"]
MODES = {"sync": [], "partial": ["--rl-partial-rollouts"]}
TABLE = 4096  # planted lengths drawn per (seed, sample index) mod this


@contextlib.contextmanager
def planted_lengths(lengths):
    """EOS the argmax of a row from the step its planted length ends at and never before
(``lengths``: [TABLE])."""
    import torch

    from puzzle.rollout import pipelined_generation

    original = pipelined_generation.sample_tokens

    def sample_tokens(logits, params, *, seed=0, sample_ids=None, step=0, **kw):
        if sample_ids is not None and params.eos_id is not None:
            s = int(seed) if not isinstance(seed, torch.Tensor) else int(seed.reshape(-1)[0])
            want = lengths[(sample_ids.cpu() * 2654435761 + s * 97) % TABLE].to(logits.device)
            stop = torch.as_tensor(step, device=logits.device) >= want - 1
            logits = logits.clone()
            logits[:, params.eos_id] += torch.where(stop, 1e4, -1e4).to(logits.dtype)  # no other ends
        return original(logits, params, seed=seed, sample_ids=sample_ids, step=step, **kw)

    pipelined_generation.sample_tokens = sample_tokens
    try:
        yield
    finally:
        pipelined_generation.sample_tokens = original


def _lengths(kind: str, cap: int):
    import torch

    if kind == "all_equal":
        return torch.full((TABLE,), cap, dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    x = torch.empty(TABLE).exponential_(1.0 / 0.16, generator=g).clamp(max=1.0)
    return (x * cap).long().clamp(min=1)


def _trainer(argv):
    from puzzle.arguments import parse_args, validate_args
    from puzzle.data.prompts import PromptLoader, load_prompt_dataset
    from puzzle.data.tokenizers import build_tokenizer, fit_to_rows
    from puzzle.dataflow.trainer import PPOTrainer

    import torch.distributed as dist

    args = parse_args(argv)
    tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model)
    cfg = validate_args(args, dist.get_world_size(), tokenizer.vocab_size)
    data = load_prompt_dataset(cfg.prompt_data, tokenizer, cfg.prompt_key, max_prompt_len=cfg.ppo.max_prompt_length)
    fit_to_rows(tokenizer, cfg.roles["actor"].arch.vocab_size, data.prompts)
    loader = PromptLoader(data.prompts, cfg.ppo.rollout_batch_size, dp_rank=0, dp_size=1, seed=cfg.seed)

    def next_prompts():
        pb = next(loader)
        return pb.prompts, [data.records[i] if data.records else {} for i in pb.indices]
    return PPOTrainer(cfg, tokenizer, data), next_prompts


def _run(args, kind: str) -> list:
    """Both modes' trainers built, one warm-up iteration each, then the timed iterations
    alternating between the modes (the first mode alternating too), so that load from other
    processes that comes and goes falls on both."""
    R = args.max_new_tokens
    runs = {}
    for mode in MODES:
        extra = ["--rl-partial-rollouts-oversample", str(args.oversample)] if mode == "partial" else []
        argv = MODEL + RUN + MODES[mode] + extra + [
            "--n-samples-per-prompt", str(args.n_samples), "--seq-length", str(R + 16),
            "--max-position-embeddings", str(R + 16), "--max-new-tokens", str(R),
            "--train-iters", str(args.iterations + 1)]
        runs[mode] = (*_trainer(argv), {"wall": 0.0, "gen": [], "lengths": [], "samples": 0})
    try:
        with planted_lengths(_lengths(kind, R)):
            for trainer, next_prompts, _ in runs.values():
                trainer.step(*next_prompts(), refill=next_prompts)  # warm-up
            order = list(MODES)
            for i in range(args.iterations):
                for mode in (order if i % 2 == 0 else order[::-1]):
                    trainer, next_prompts, acc = runs[mode]
                    t0 = time.perf_counter()
                    m = trainer.step(*next_prompts(), refill=next_prompts)
                    acc["wall"] += time.perf_counter() - t0
                    acc["samples"] += trainer.cfg.ppo.num_samples
                    acc["gen"].append(m["time_generate"])
                    acc["lengths"].append(m["response_length_mean"])
    finally:
        for trainer, _, _ in runs.values():
            trainer.close()
    rows = []
    for mode, (_, _, acc) in runs.items():
        rows.append({"distribution": kind, "mode": mode, "samples_per_s": acc["samples"] / acc["wall"],
                     "wall_s": acc["wall"], "generation_s_per_iteration": sum(acc["gen"]) / len(acc["gen"]),
                     "response_length_mean": sum(acc["lengths"]) / len(acc["lengths"]),
                     "iterations": args.iterations, "max_new_tokens": R, "n_samples_per_prompt": args.n_samples,
                     **({"oversample": args.oversample} if mode == "partial" else {})})
    return rows


def _worker(args) -> int:
    import megatron_patches

    megatron_patches.apply()
    from puzzle.parallel.groups import init_distributed

    init_distributed()
    for kind in args.distributions.split(","):
        for row in _run(args, kind):
            print("ROW " + json.dumps(row), flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=6, help="timed iterations per mode (after one warm-up)")
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--n-samples", type=int, default=4, help="--n-samples-per-prompt (the group size)")
    ap.add_argument("--oversample", type=float, default=2.0, help="--rl-partial-rollouts-oversample")
    ap.add_argument("--distributions", default="long_tailed,all_equal")
    ap.add_argument("--out", default=None, help="also write the rows to this JSON file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return _worker(args)
    from puzzle.bench.worker_ranks import torchrun_rows

    rows = []
    rc = torchrun_rows("puzzle.bench.long_tail", 1, [
        "--iterations", str(args.iterations), "--max-new-tokens", str(args.max_new_tokens),
        "--n-samples", str(args.n_samples), "--oversample", str(args.oversample),
        "--distributions", args.distributions], rows)
    for kind in ("long_tailed", "all_equal"):
        by = {r["mode"]: r for r in rows if r["distribution"] == kind}
        if {"sync", "partial"} <= set(by):
            ratio = {"distribution": kind, "ratio_partial_over_sync":
                     by["partial"]["samples_per_s"] / by["sync"]["samples_per_s"]}
            rows.append(ratio)
            print(json.dumps(ratio), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return rc


if __name__ == "__main__":
    sys.exit(main())
