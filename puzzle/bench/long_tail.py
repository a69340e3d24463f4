"""Benchmark: trained samples/s of a tiny GRPO run, synchronous against --rl-partial-rollouts and
against the overlap of a generation pool and a training pool (--rl-desired-lag 1).

    python -m puzzle.bench.long_tail [--iterations 6] [--repeats 2] [--warmup 2] [--max-new-tokens 192] [--n-samples 4] [--oversample 2] [--profile cpu_long_tail_4ranks] [--distributions long_tailed,all_equal] [--out rows.json]

In ONE run (one 4-rank torchrun world; ``MODES`` and ``LAYOUTS`` give each mode's layouts, also in
the rows), the tiny GRPO model of examples/run_grpo_tiny.sh (random weights) trains with whole
iterations (generation, rewards, scoring, training) on two response-length distributions
(``DISTRIBUTIONS``): ``long_tailed`` as ``puzzle.bench.packing.response_lengths`` draws it
(exponential, mean/max ~0.16 of --max-new-tokens, the first row of each rollout at the cap: the
sample of every rollout-batch-size-th global index, a response truncated at --max-new-tokens, as
long-tailed runs on a GPU have them) and ``all_equal`` (every response at the cap); on request also
``long_tailed_uncapped`` (the same exponential without the rows at the cap, what this bench drew
before). A random model has no length distribution of its own, so the lengths are planted: each
sample's end-of-sequence token is made the argmax once its response reaches the length drawn for
its (seed, sample index), and is never sampled before; the log-probs recorded are the model's. Each
run (``PPOTrainer.train``) has ``--warmup`` untimed iterations (partial rollouts' carried buffer
fills; the overlap's pipeline fills) and ``--iterations`` timed ones; the overlap's run has two
more untimed ones after them (its drain: the training step of the next-to-last batch sends no
weights, so that iteration does not wait for a generation and lasts its training alone; timed, it
would flatter the overlap by about (n x generation) / ((n-1) x generation + training) over n timed
iterations). ``--repeats`` runs of each mode, the first mode alternating between repeats (load from
other processes falls on both). samples/s = trained samples / the summed iteration wall times (the
metrics' ``samples_per_sec``) of a mode's timed iterations (the overlap's: the training pool's
iterations, each from waiting for its batch to the end of its training, its weights' switch to the
generation pool included, which waits for the generation pool's current batch);
``ratio_<mode>_over_sync`` the median of the repeats' own ratios. The JSON rows also carry
generation seconds per iteration (the overlap's: the training pool's wait for its batch, and
``generation_pool_s_per_iteration`` the generation pool's own), scoring and training seconds, the
trained responses' mean length and the host's load average at the start and the end of the
distribution's runs.

Beside the measurement, each distribution's ratio row carries the plan search's prediction
(``prediction``: puzzle.plan_search.command.predict_modes with each mode's own flags and layouts,
the planted distribution and ``--profile``): the mode it chooses, each mode's estimated seconds
per iteration and samples/s, the measured fastest mode and whether the two agree.

Read with the lengths: in a short run the partial mode trains shorter responses on average than
were drawn (the long ones are still carried), which makes its scoring and training cheaper; and
with equal lengths every served group finishes at once, so the groups beyond the quota are
carried finished and the next iteration generates nothing (two batches per generation).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
from pathlib import Path

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
         "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--tokenizer-type", "ByteLevelTokenizer",
         "--init-random", "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1"]
ROLLOUT_BATCH = 16
RUN = ["--advantage-estimator", "grpo", "--rollout-batch-size", str(ROLLOUT_BATCH),
       "--micro-batch-size", "16", "--lr", "3e-3", "--seed", "1234", "--temperature", "1.0", "--kl-coef", "0",
       "--prompt-data", "puzzle/data/bundled/tiny_arithmetic.jsonl",
       "--reward-fn", "puzzle.reward_functions.builtin:lowercase_fraction", "--reward-timeout", "0",
       "--rl-inference-logprobs-is-correction", "--log-interval", "1000"]
RANKS = 4
#: each mode's flags and layouts on the 4 ranks: sync and partial train at D=4 and generate in one
#: share at T=4 (partial rollouts need one generating share at P=1; sync takes the same layouts);
#: the overlap trains at D=2 on ranks 0-1 and generates at T=2 on ranks 2-3 (lag 1)
MODES = {"sync": ["--actor-gen-tensor-model-parallel-size", "4"],
         "partial": ["--rl-partial-rollouts", "--actor-gen-tensor-model-parallel-size", "4"],
         "overlap": ["--rl-desired-lag", "1", "--actor-gen-rank-offset", "2",
                     "--actor-gen-tensor-model-parallel-size", "2"]}
LAYOUTS = {"sync": "train 1,4,1; generate 1,1,4", "partial": "train 1,4,1; generate 1,1,4",
           "overlap": "train 1,2,1 (ranks 0-1); generate 1,1,2@2 (ranks 2-3); lag 1"}
TABLE = 4096  # planted lengths drawn per (seed, sample index) mod this


#: each distribution's draw: (kind, mean as a fraction of the cap or None, rows at the cap: 1 in a rollout)
DISTRIBUTIONS = {"long_tailed": ("exponential", 0.16, True), "all_equal": ("fixed", None, False),
                 "long_tailed_uncapped": ("exponential", 0.16, False)}


def response_lengths(kind: str, cap: int, samples: int):
    """The plan search's ResponseLengths of distribution ``kind`` (``samples`` per rollout)."""
    from puzzle.plan_search.long_tail import ResponseLengths

    shape, mean, capped = DISTRIBUTIONS[kind]
    return ResponseLengths(shape, cap, mean=(mean or 0.0) * cap, cap_every=samples if capped else 0)


@contextlib.contextmanager
def planted_lengths(lengths, cap: int = 0, cap_every: int = 0):
    """EOS the argmax of a row from the step its planted length ends at and never before
    (``lengths``: [TABLE]; ``cap_every`` k > 0: the samples of index 0, k, 2k, ... at ``cap``)."""
    import torch

    from puzzle.rollout import pipelined_generation
    from puzzle.rollout.sampling import vocab_start

    original = pipelined_generation.sample_tokens

    def sample_tokens(logits, params, *, seed=0, sample_ids=None, step=0, **kw):
        eos = None if params.eos_id is None else params.eos_id - vocab_start(logits.shape[1], kw.get("tp_group"))
        if sample_ids is not None and eos is not None and 0 <= eos < logits.shape[1]:  # (this TP rank's shard)
            s = int(seed) if not isinstance(seed, torch.Tensor) else int(seed.reshape(-1)[0])
            ids = sample_ids.cpu()
            want = lengths[(ids * 2654435761 + s * 97) % TABLE]
            if cap_every:
                want = torch.where(ids % cap_every == 0, cap, want)
            want = want.to(logits.device)
            stop = torch.as_tensor(step, device=logits.device) >= want - 1
            logits = logits.clone()
            logits[:, eos] += torch.where(stop, 1e4, -1e4).to(logits.dtype)  # no other ends
        return original(logits, params, seed=seed, sample_ids=sample_ids, step=step, **kw)

    pipelined_generation.sample_tokens = sample_tokens
    try:
        yield
    finally:
        pipelined_generation.sample_tokens = original


def _lengths(kind: str, cap: int):
    import torch

    shape, mean, _ = DISTRIBUTIONS[kind]
    if shape == "fixed":
        return torch.full((TABLE,), cap, dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    x = torch.empty(TABLE).exponential_(1.0 / mean, generator=g).clamp(max=1.0)
    return (x * cap).long().clamp(min=1)


def _train(argv, timed: range) -> list:
    """One run of ``argv`` (PPOTrainer.train, the prompt loader its own) in this world; its
    metric rows of the ``timed`` iterations (rank 0's; the other ranks: none)."""
    import tempfile

    import torch.distributed as dist

    from puzzle.arguments import parse_args, validate_args
    from puzzle.data.prompts import load_prompt_dataset
    from puzzle.data.tokenizers import build_tokenizer, fit_to_rows
    from puzzle.dataflow.trainer import PPOTrainer

    from puzzle.parallel.device import runtime

    with tempfile.TemporaryDirectory(prefix="puzzle-long-tail-") as mine:
        d = runtime().broadcast_object(mine)  # rank 0's: it writes the metrics
        args = parse_args(argv + ["--log-dir", d])
        tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model)
        cfg = validate_args(args, dist.get_world_size(), tokenizer.vocab_size)
        data = load_prompt_dataset(cfg.prompt_data, tokenizer, cfg.prompt_key,
                                   max_prompt_len=cfg.ppo.max_prompt_length)
        fit_to_rows(tokenizer, cfg.roles["actor"].arch.vocab_size, data.prompts)
        run = PPOTrainer(cfg, tokenizer, data)
        try:
            run.train()
        finally:
            run.close()
        rows = [json.loads(line) for line in open(os.path.join(d, "metrics.jsonl"))] if dist.get_rank() == 0 else []
        dist.barrier()  # rank 0 has read its directory before it goes
    return [r for r in rows if r.get("iteration", 0) in timed]


def mode_argv(args, mode: str) -> list:
    """The train_ppo.py flags of ``mode``'s runs (without --train-iters)."""
    R = args.max_new_tokens
    extra = ["--rl-partial-rollouts-oversample", str(args.oversample)] if mode == "partial" else []
    return MODEL + RUN + MODES[mode] + extra + [
        "--n-samples-per-prompt", str(args.n_samples), "--seq-length", str(R + 16),
        "--max-position-embeddings", str(R + 16), "--max-new-tokens", str(R)]


#: untimed iterations after the timed ones: the overlap's drain (see the module docstring)
DRAIN = {"overlap": 2}


def _mean(xs) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _run(args, kind: str) -> list:
    """``--repeats`` runs of each mode, the first mode alternating between repeats (load from
    other processes that comes and goes falls on both); per mode the timed iterations of all
    repeats summed, and the ratio of the modes the median of the repeats' own ratios."""
    R = args.max_new_tokens
    acc = {mode: {"seconds": 0.0, "samples": 0, "gen": [], "pool": [], "score": [], "train": [], "lengths": []}
           for mode in MODES}
    ratios, load = [], [round(os.getloadavg()[0], 2)]
    timed = range(args.warmup + 1, args.warmup + args.iterations + 1)
    per_rollout = args.n_samples * ROLLOUT_BATCH
    table, cap_every = _lengths(kind, R), response_lengths(kind, R, per_rollout).cap_every  # the same every run
    for rep in range(args.repeats):
        per = {}
        for mode in (list(MODES) if rep % 2 == 0 else list(MODES)[::-1]):
            argv = mode_argv(args, mode) + ["--train-iters", str(timed.stop - 1 + DRAIN.get(mode, 0))]
            with planted_lengths(table, R, cap_every):
                rows = _train(argv, timed)
            if not rows:  # not rank 0
                continue
            samples = per_rollout * len(rows)
            seconds = sum(per_rollout / r["samples_per_sec"] for r in rows)
            per[mode] = samples / seconds
            a = acc[mode]
            a["seconds"] += seconds
            a["samples"] += samples
            for key, metric in (("gen", "time_generate"), ("pool", "generation_pool_seconds"), ("score", "time_score"),
                                ("train", "time_train"), ("lengths", "response_length_mean")):
                a[key] += [r[metric] for r in rows if metric in r]
        if per:
            ratios.append({m: per[m] / per["sync"] for m in MODES if m != "sync"})
    if not ratios:
        return []
    load.append(round(os.getloadavg()[0], 2))
    out = []
    for mode, a in acc.items():
        out.append({"distribution": kind, "mode": mode, "samples_per_s": a["samples"] / a["seconds"],
                    "seconds": a["seconds"], "generation_s_per_iteration": _mean(a["gen"]),
                    **({"generation_pool_s_per_iteration": _mean(a["pool"])} if a["pool"] else {}),
                    "score_s_per_iteration": _mean(a["score"]), "train_s_per_iteration": _mean(a["train"]),
                    "response_length_mean": _mean(a["lengths"]),
                    "iterations": args.iterations, "warmup": args.warmup, "repeats": args.repeats, "max_new_tokens": R,
                    "n_samples_per_prompt": args.n_samples, "ranks": RANKS, "layouts": LAYOUTS[mode],
                    **({"oversample": args.oversample} if mode == "partial" else {})})
    medians = {m: statistics.median(r[m] for r in ratios) for m in MODES if m != "sync"}
    out.append({"distribution": kind, **{f"ratio_{m}_over_sync": v for m, v in medians.items()},
                "ratios_of_repeats": ratios, "load_average": load,
                "prediction": prediction(args, kind, medians)})
    return out


def prediction(args, kind: str, medians: dict) -> dict:
    """The plan search's choice for ``kind`` (each mode priced at its own flags' layouts, the
    planted distribution, ``--profile``) beside the measured fastest mode (by the median ratios)."""
    from puzzle.plan_search.command import predict_modes

    samples = args.n_samples * ROLLOUT_BATCH
    lengths = response_lengths(kind, args.max_new_tokens, samples)
    report = predict_modes({m: mode_argv(args, m) for m in MODES}, lengths, RANKS, args.profile)
    fastest = max(medians, key=medians.get) if max(medians.values()) > 1.0 else "sync"
    est = {e.mode: e.iteration_s for e in report.estimates if e.available}
    return {"profile": args.profile, "lengths": lengths.describe(), "predicted": report.choice,
            "measured_fastest": fastest, "matches": report.choice == fastest,
            "estimated_s_per_iteration": {m: round(v, 3) for m, v in est.items()},
            "estimated_samples_per_s": {m: round(samples / v, 3) for m, v in est.items()},
            "estimated_ratio_over_sync": {m: round(est["sync"] / est[m], 3) for m in est if m != "sync"},
            "layouts": {e.mode: e.layout for e in report.estimates if e.available}}


def _worker(args) -> int:
    import megatron_patches

    megatron_patches.apply()
    from puzzle.parallel.groups import init_distributed

    init_distributed()
    for kind in args.distributions.split(","):
        for row in _run(args, kind):  # (rank 0's)
            print("ROW " + json.dumps(row), flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=6, help="timed iterations per run (after --warmup untimed ones)")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each mode")
    ap.add_argument("--warmup", type=int, default=2, help="untimed iterations at the start of each run")
    ap.add_argument("--profile", default="cpu_long_tail_4ranks",
                    help="the plan-search profile the prediction is priced with (a bundled name or a file)")
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--n-samples", type=int, default=4, help="--n-samples-per-prompt (the group size)")
    ap.add_argument("--oversample", type=float, default=2.0, help="--rl-partial-rollouts-oversample")
    ap.add_argument("--distributions", default="long_tailed,all_equal",
                    help="comma-separated, of: " + ", ".join(DISTRIBUTIONS))
    ap.add_argument("--out", default=None, help="also write the rows to this JSON file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return _worker(args)
    if args.iterations < 1 or args.warmup < 0 or args.repeats < 1:
        ap.error("--iterations and --repeats must be >= 1, --warmup >= 0")
    unknown = [k for k in args.distributions.split(",") if k not in DISTRIBUTIONS]
    if unknown:
        ap.error(f"--distributions: unknown {', '.join(unknown)} (known: {', '.join(DISTRIBUTIONS)})")
    if os.path.exists(args.profile):  # the workers run in the repository's root
        args.profile = os.path.abspath(args.profile)
    from puzzle.plan_search.profile_data import ProfileError, load_profile

    try:
        load_profile(args.profile)
    except ProfileError as e:
        ap.error(f"--profile: {e}")
    from puzzle.bench.worker_ranks import torchrun_rows

    rows = []
    rc = torchrun_rows("puzzle.bench.long_tail", RANKS, [
        "--iterations", str(args.iterations), "--repeats", str(args.repeats), "--warmup", str(args.warmup),
        "--profile", args.profile, "--max-new-tokens", str(args.max_new_tokens),
        "--n-samples", str(args.n_samples), "--oversample", str(args.oversample),
        "--distributions", args.distributions], rows)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return rc


if __name__ == "__main__":
    sys.exit(main())
