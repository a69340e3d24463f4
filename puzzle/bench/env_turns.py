"""Benchmark: multi-turn generation with a slow environment step, the steps overlapped with decoding.

    python -m puzzle.bench.env_turns [--sleep-ms 50] [--overlap-calls 0 4 16] [--rows 16]
                                     [--workers 8] [--repeats 3]

One rank (its own torchrun world) generates multi-turn samples from a small byte-level LLaMA
(random weights, 2 layers, hidden 64) through the real environment path: ``EpisodeTurns`` over an
``EnvRunner`` whose ``--workers`` worker processes run ``SleepyEcho`` (below: each step sleeps
``--sleep-ms``, then answers a short observation). A turn ends at any of 32 one-byte stops (about
one token in eight of the random model's); 4 turns at most, 64 new tokens, ``--rows`` rows in one
KV cache. For each ``--overlap-calls`` k (``--env-step-overlap-calls``: a step is joined k model
calls after its turn ended; 0: every row waits for the steps before the next call, as before the
overlap) one JSON row: the median seconds of ``--repeats`` generations after a warm-up (the
settings taken in turn), the same with an instant step (``--sleep-ms 0``), ``step_wait_seconds``
(the decode loop's time blocked at the joins, waiting for steps: what the overlap did not hide),
the model calls and the steps. The last row compares the largest k with 0: the fraction of the
wait it hides and the speedup. No timed asserts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import List, Optional

STOPS = tuple(chr(c) for c in range(32, 64))  # 32 one-byte turn stops


class SleepyEcho:
    """An environment whose every step takes the record's ``sleep_ms`` milliseconds (a slow tool)."""

    turn_stops = STOPS

    def reset(self, record):
        self.n, self.sleep_s = 0, float(record.get("sleep_ms", 0)) / 1000

    def step(self, turn):
        time.sleep(self.sleep_s)
        self.n += 1
        return f"={self.n}", 1.0, False


def _worker(args) -> None:
    import megatron_patches

    megatron_patches.apply()
    import torch
    import torch.distributed as dist

    from puzzle.config import ModelArch
    from puzzle.data.tokenizers import ByteTokenizer
    from puzzle.dataflow.env_turns import EpisodeTurns
    from puzzle.engine.model_engine import ModelEngine
    from puzzle.parallel.groups import init_distributed, layout_for
    from puzzle.parallel.plan import ParallelPlan
    from puzzle.reward_functions.env_runner import EnvRunner
    from puzzle.reward_functions.environments import EnvSpec
    from puzzle.rollout.generation import generate
    from puzzle.rollout.sampling import SamplingParams

    init_distributed()
    tok = ByteTokenizer()
    arch = ModelArch.llama(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                           num_query_groups=4, vocab_size=tok.vocab_size, make_vocab_size_divisible_by=64,
                           seq_length=96)
    engine = ModelEngine("actor", arch, layout_for(ParallelPlan(1, 1, 1)), trainable=False, seed=7)
    g = torch.Generator().manual_seed(3)
    prompts = [[int(v) for v in torch.randint(64, 256, (8,), generator=g)] for _ in range(args.rows)]
    stops = [tok.encode(s) for s in STOPS]
    params = SamplingParams(64, temperature=1.0, eos_id=None, pad_id=tok.pad_id)
    runner = EnvRunner(EnvSpec.of("puzzle.bench.env_turns:SleepyEcho"), workers=args.workers, timeout=10.0)

    def run(k: int, sleep_ms: float):
        records = [{"sleep_ms": sleep_ms} for _ in prompts]
        episodes = EpisodeTurns(runner, tok, prompts, records, 4, 16, stops, None, k)
        t0 = time.perf_counter()
        o = generate(engine, prompts, params, seed=1, micro_batch_size=args.rows, turns=episodes)
        return time.perf_counter() - t0, o

    configs = [(k, ms) for k in args.overlap_calls for ms in (args.sleep_ms, 0.0)]
    times = {c: [] for c in configs}
    outs = {}
    try:
        for c in configs:
            run(*c)  # warm-up (the workers start)
        for _ in range(args.repeats):  # the settings in turn, so that a slower spell of the machine hits all
            for c in configs:
                t, outs[c] = run(*c)
                times[c].append((t, outs[c].turn_counts["step_wait_seconds"]))
    finally:
        runner.close()
    rows = []
    for k in args.overlap_calls:
        slow, fast, o = times[k, args.sleep_ms], times[k, 0.0], outs[k, args.sleep_ms]
        rows.append({"overlap_calls": k, "sleep_ms": args.sleep_ms, "rows": args.rows, "workers": args.workers,
                     "seconds": round(statistics.median(t for t, _ in slow), 4),
                     "seconds_instant_step": round(statistics.median(t for t, _ in fast), 4),
                     "step_wait_seconds": round(statistics.median(w for _, w in slow), 4),
                     "step_wait_seconds_instant_step": round(statistics.median(w for _, w in fast), 4),
                     "model_calls": o.forward_passes, "env_steps": o.turn_counts["turns"],
                     "observation_tokens": o.turn_counts["observation_tokens"],
                     "tokens": int(o.response_lengths.sum())})
    for row in rows:
        print("ROW " + json.dumps(row), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sleep-ms", type=float, default=50.0)
    ap.add_argument("--overlap-calls", type=int, nargs="+", default=[0, 4, 16])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if min(args.overlap_calls) < 0 or args.rows < 1 or args.workers < 1 or args.repeats < 1 or args.sleep_ms < 0:
        raise SystemExit("--overlap-calls must be >= 0; --rows, --workers, --repeats >= 1; --sleep-ms >= 0")
    if args.worker:
        _worker(args)
        return 0
    from puzzle.bench.worker_ranks import torchrun_rows

    rows = []
    rc = torchrun_rows("puzzle.bench.env_turns", 1, [
        "--sleep-ms", str(args.sleep_ms), "--rows", str(args.rows), "--workers", str(args.workers),
        "--repeats", str(args.repeats), "--overlap-calls", *map(str, args.overlap_calls)], rows)
    if rc:
        return rc
    sync = next((r for r in rows if r["overlap_calls"] == 0), None)
    best = max(rows, key=lambda r: r["overlap_calls"])
    if sync is not None and best is not sync and sync["step_wait_seconds"] > 0:
        print(json.dumps({"compare": f"overlap_calls {best['overlap_calls']} vs 0",
                          "step_wait_hidden": round(1 - best["step_wait_seconds"] / sync["step_wait_seconds"], 3),
                          "speedup": round(sync["seconds"] / best["seconds"], 3)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
