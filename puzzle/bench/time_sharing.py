"""Benchmark: intra-stage time-sharing (PUZZLE §4.2, Eq. (1)) vs sequential 1F1B on megatron.

    python -m puzzle.bench.time_sharing [--nproc 2] [--repeats 5] [--out rows.json]

Spawns its own torchrun world (gloo, OMP_NUM_THREADS=1, one pipeline of P=nproc stages) and, in
ONE run, times the same two training contexts (forward+backward, no optimizer step) executed
  sequential   - megatron's forward_backward_pipelining_without_interleaving per model, and
  time-shared  - puzzle.pipeline.time_sharing_executor.run_time_shared (one interleaved 1F1B stream),
for (a) two equal models and (b) two unequal ones (different hidden size), N_B = 4 and 8.
Per-microbatch T^f / T^b of each model are measured by timing megatron's forward_step /
backward_step on every stage during a profiling run; the theoretical speedup is Eq. (1) with the
slowest stage's medians.  Wall times: max over ranks, median of ``--repeats``.  Peak RSS: current
RSS sampled after every forward_step / backward_step in a separate (untimed) run of each mode,
max over ranks, with a fixed glibc mmap threshold so freed activations leave the RSS.
Prints one JSON row per (config, N_B).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = {
    # name: (hidden_A, hidden_B)
    "equal": (256, 256),
    "unequal": (384, 192),
}
NUM_LAYERS = 4
SEQ, MBS = 64, 2


def _arch(hidden: int, P: int):
    from puzzle.config import ModelArch

    layers = max(NUM_LAYERS, P) // P * P
    return ModelArch.llama(num_layers=layers, hidden_size=hidden, ffn_hidden_size=4 * hidden,
                           num_attention_heads=8, num_query_groups=8, vocab_size=256,
                           make_vocab_size_divisible_by=128, seq_length=SEQ)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _value_step(data_iterator, model):
    import torch

    mb = next(data_iterator)
    pos = torch.arange(mb.shape[1]).unsqueeze(0).expand_as(mb)
    out = model(mb, pos, None)

    def loss_func(v):
        loss = v.float().pow(2).sum()
        return loss, torch.tensor(v.numel(), dtype=torch.int), {"loss": loss.detach()}

    return out, loss_func


class _Probe:
    """Wraps megatron's forward_step/backward_step (module attributes, looked up at call time by
    both megatron's schedule and our executor) to time them per model or sample the RSS."""

    def __init__(self, configs_to_name):
        import megatron.core.pipeline_parallel.schedules as sch

        self.sch = sch
        self.names = configs_to_name  # id(config) -> model name
        self.times = {}  # (name, 'f'|'b') -> [seconds]
        self.rss_peak = 0.0
        self.mode = None  # 'time' | 'rss' | None

    def __enter__(self):
        sch, probe = self.sch, self
        self._f, self._b = sch.forward_step, sch.backward_step
        f0, b0 = self._f, self._b

        def forward_step(forward_step_func, data_iterator, model, *a, **kw):
            from megatron.core.utils import get_model_config

            t = time.perf_counter()
            out = f0(forward_step_func, data_iterator, model, *a, **kw)
            probe._record(id(get_model_config(model)), "f", time.perf_counter() - t)
            return out

        def backward_step(input_tensor, output_tensor, output_tensor_grad, model_type, config):
            t = time.perf_counter()
            out = b0(input_tensor, output_tensor, output_tensor_grad, model_type, config)
            probe._record(id(config), "b", time.perf_counter() - t)
            return out

        sch.forward_step, sch.backward_step = forward_step, backward_step
        return self

    def _record(self, cfg_id, kind, dt):
        if self.mode == "time":
            self.times.setdefault((self.names[cfg_id], kind), []).append(dt)
        elif self.mode == "rss":
            self.rss_peak = max(self.rss_peak, _rss_mb())

    def __exit__(self, *exc):
        self.sch.forward_step, self.sch.backward_step = self._f, self._b


def _worker(args) -> None:
    import megatron_patches

    megatron_patches.apply()
    import torch
    import torch.distributed as dist

    from puzzle.parallel.groups import init_distributed, layout_for
    from puzzle.parallel.plan import ParallelPlan
    from puzzle.engine.model_engine import ModelEngine, OptimConfig

    rank, world = init_distributed()
    P = world
    layout = layout_for(ParallelPlan(P, 1, 1))
    torch.manual_seed(0)
    rows = []
    for cname, (ha, hb) in CONFIGS.items():
        engines = [ModelEngine("critic", _arch(ha, P), layout, trainable=True,
                               optim=OptimConfig(lr=1e-4), seed=1),
                   ModelEngine("critic", _arch(hb, P), layout, trainable=True,
                               optim=OptimConfig(lr=1e-4), seed=2)]
        for nb in args.nb:
            row = _measure_pair(args, engines, nb, world)
            rows.append({"config": f"{cname} (hidden {ha}/{hb})", "P": P, "N_B": nb, **row})
            if rank == 0:
                print("ROW " + json.dumps(rows[-1]), flush=True)
    if rank == 0 and args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def _global_max(x: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _run_stream(engines, data, nb: int, mode: str, stats=None) -> float:
    """One training stream of both models, sequential or time-shared: the slowest rank's seconds."""
    import torch.distributed as dist

    from puzzle.pipeline import time_sharing_executor
    from puzzle.pipeline.stage import StageContext, run_stage

    for e in engines:
        e.zero_grad()
    ctxs = [StageContext(e, _value_step, iter(d.split(MBS)), nb, SEQ, MBS) for e, d in zip(engines, data)]
    dist.barrier()
    t = time.perf_counter()
    if mode == "sequential":
        run_stage(ctxs, forward_only=False, placement="sequential")
    else:
        time_sharing_executor.run_time_shared(ctxs, forward_only=False, stats=stats)
    return _global_max(time.perf_counter() - t)


def _measure_pair(args, engines, nb: int, world: int) -> dict:
    """Per-microbatch stage times (profiled), peak RSS, and the measured, Eq. (1) and simulated
    speedups of time-sharing the two engines with ``nb`` micro-batches each."""
    import torch
    import torch.distributed as dist

    from puzzle.pipeline import time_sharing_executor
    from puzzle.pipeline.time_sharing_schedule import ContextSpec, simulate, theoretical_speedup

    P = world
    names = {id(e.config): f"m{k}" for k, e in enumerate(engines)}
    data = [torch.randint(0, 256, (nb * MBS, SEQ), generator=torch.Generator().manual_seed(k))
            for k in range(2)]
    with _Probe(names) as probe:
        _run_stream(engines, data, nb, "sequential")  # warm-up
        _run_stream(engines, data, nb, "time-shared")
        probe.mode = "time"
        _run_stream(engines, data, nb, "sequential")  # profiling run: per-microbatch T^f / T^b on this stage
        probe.mode = None
        med = {k: statistics.median(v) for k, v in probe.times.items()}
        rss = {}
        for mode in ("sequential", "time-shared"):
            probe.rss_peak = 0.0
            probe.mode = "rss"
            _run_stream(engines, data, nb, mode)
            probe.mode = None
            rss[mode] = _global_max(probe.rss_peak)
    # per-stage medians from every rank -> slowest stage for Eq. (1)
    per_rank = [None] * world
    dist.all_gather_object(per_rank, {f"{n}.{k}": v for (n, k), v in med.items()})
    tf = [max(r[f"m{k}.f"] for r in per_rank) for k in range(2)]
    tb = [max(r[f"m{k}.b"] for r in per_rank) for k in range(2)]
    seq_t, ts_t = [], []
    stats = time_sharing_executor.ExecStats()
    for _ in range(args.repeats):
        seq_t.append(_run_stream(engines, data, nb, "sequential"))
        ts_t.append(_run_stream(engines, data, nb, "time-shared", stats))
    peaks = [None] * world
    dist.all_gather_object(peaks, (stats.peak_in_flight, stats.sequential_peak, stats.mode))
    specs = [ContextSpec("m0", nb), ContextSpec("m1", nb)]
    fw = [[r[f"m{k}.f"] for r in per_rank] for k in range(2)]
    bw = [[r[f"m{k}.b"] for r in per_rank] for k in range(2)]
    sim = (simulate(P, specs, fw, bw, time_shared=False).makespan
           / simulate(P, specs, fw, bw, time_shared=True).makespan)
    measured = statistics.median(seq_t) / statistics.median(ts_t)
    theo = theoretical_speedup(P, nb, tf, tb)
    return {
        "seq_s": round(statistics.median(seq_t), 4),
        "time_shared_s": round(statistics.median(ts_t), 4),
        "measured_speedup": round(measured, 4),
        "theoretical_speedup": round(theo, 4),
        "ratio": round(measured / theo, 4),
        "simulated_speedup_per_stage_times": round(sim, 4),
        "Tf_ms": [round(1e3 * x, 2) for x in tf], "Tb_ms": [round(1e3 * x, 2) for x in tb],
        "peak_rss_mb_sequential": round(rss["sequential"], 1),
        "peak_rss_mb_time_shared": round(rss["time-shared"], 1),
        "peak_in_flight_per_stage": [p[0] for p in peaks],
        "sequential_peak_in_flight_per_stage": [p[1] for p in peaks],
        "mode": peaks[0][2], "repeats": args.repeats,
        "loadavg_1min": round(os.getloadavg()[0], 2), "cpu_count": os.cpu_count(),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=2, help="pipeline stages = ranks (default 2)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--nb", type=int, nargs="+", default=[4, 8], help="microbatches per model")
    ap.add_argument("--out", default="", help="also write the rows to this JSON file")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536",
               PYTHONPATH=f"{repo}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={args.nproc}", "-m", "puzzle.bench.time_sharing", "--worker",
           "--repeats", str(args.repeats), "--nb", *map(str, args.nb)]
    if args.out:
        cmd += ["--out", os.path.abspath(args.out)]
    proc = subprocess.Popen(cmd, env=env, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    out, err = proc.communicate()
    for line in out.splitlines():
        if line.startswith("ROW "):
            print(line[4:], flush=True)
    if proc.returncode != 0:
        sys.stderr.write("\n".join((out + "\n" + err).splitlines()[-60:]) + "\n")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
