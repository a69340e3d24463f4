"""On-machine profiler: writes a device profile (the ``load_profile`` JSON) for the plan search.

    python -m puzzle.tools.profile --out puzzle/plan_search/profiles/cpu_tiny.json --shapes tiny --procs 4 \\
        [--tp-sizes 1,2] [--micro-batch-sizes 1,2,4] [--seq-lengths 32,64] [--decode-batch-sizes 1,2,4,8]
    python -m puzzle.tools.profile --out my.json --num-layers 2 --hidden-size 64 --ffn-hidden-size 128 \\
        --num-attention-heads 4 --num-query-groups 2 --swiglu --seq-length 64

What is measured (real megatron-core GPTModel built by our ``ModelEngine``, on CUDA when
available, else on CPU/gloo through ``megatron_patches``), for every tensor-parallel degree T
(a world of ``procs`` ranks spawned with torchrun by this module, running ``procs / T`` replicas
of the (P, D, T) = (1, procs/T, T) layout at once):

* ``fwd_s[T]`` / ``bwd_s[T]`` per (micro-batch size x sequence length = tokens): one micro-batch
  forward / backward of the whole model as PPO runs it (embedding, layers, head, the vocab-parallel
  log-prob + entropy of ``puzzle.engine.vocab_parallel``), minus what the cost model adds back
  (its LM-head estimate; its 2 TP all-reduces per layer from the fitted latency/bandwidth),
  divided by the number of layers. The tables therefore hold the layers' kernels *and* their share
  of the per-micro-batch fixed costs the cost model has no term for (Python/launch overheads, the
  loss's own TP collectives), so the cost model reproduces the measured micro-batch at the
  profiled depth; on CPU these fixed costs dominate small models. (Floor: 10 % of the hooked
  layer-only forward time.) The layer-only time seen by forward hooks, collectives excluded, is
  ``layer_fwd_s`` in the raw results and the profile's ``layer_overhead_s`` is its minimum.
* ``decode_s[T]`` per number of sequences: one layer's share of a KV-cache decode step measured
  inside ``puzzle.rollout.generation.generate`` (forward hooks on the layers, TP collectives
  removed); ``decode_step_overhead_s``: the rest of a measured decode step (embedding, sampling
  beyond its modelled exchange, the Python loop) beyond the step the cost model itself estimates
  from these tables at P = 1 (layers, their TP all-reduces, KV read, LM head, sampling exchange),
  median over every T and batch size; ``decode_step_overhead_s_by_tp`` the median of each T (the
  embedding's and the sampling's other collectives make it grow with T).
* collectives over groups of 2 ranks (pairs run at the same time, as in a run): all-reduce
  latency/bandwidth fit ``t = latency + 2(n-1)/n * bytes / bandwidth`` -> ``intra_node_*``;
  all-reduce over the groups of every larger T of ``--tp-sizes`` (the TP groups, all at once):
  each group size's latency -> ``allreduce_latency_s_by_ranks`` (4 ranks on 2 cores: ~4x a pair's);
  point-to-point send/recv is fitted too (recorded in the comment; the cost model uses the
  all-reduce figures for both). Bandwidths are *per bf16 byte*: the cost model counts 2 bytes per
  element, so a run in fp32 (CPU) moves twice that and the reported bandwidth is halved.
* How the samples are taken: a shared machine changes speed by +-20 % over a few seconds, so
  every point (training, decode, collectives) is sampled in ``--rounds`` rounds that visit all
  points in turn, and its median spans the whole profiling time; all ranks start each sample
  together (a barrier), as the ranks of a run are busy together; a decode step is the difference
  of a 1-token and an n-token ``generate()`` taken back to back.
* GEMM rate (``peak_flops``: best fp32/bf16 matmul rate seen, ``gemm_efficiency`` 1.0,
  ``gemm_half_efficiency_flops`` from a small GEMM), memory streaming rate (``hbm_bandwidth``:
  a large tensor copy), ``device_memory_bytes`` (GPU memory, or host RAM / procs on CPU),
  ``memory_reserved_bytes`` (the worker's resident memory before any model: torch, megatron),
  ``host_cores`` on a CPU host (the cores the ranks share) and ``host_background_load`` (its
  1-minute load average before the profiling world started: the other work the tables were
  measured beside).

``--procs``: how many ranks share this host in the run the profile is for. A CPU "device" is a
share of the host: 4 ranks on 2 cores each run at about half speed and their collectives wait
for the scheduler, so profile with the run's rank count (4 for examples/run_ppo_tiny.sh).

Writing a profile by hand for a cluster we do not have: copy ``profiles/a100_80gb.json``, set the
``hardware`` block from the vendor's figures (memory per device, ranks per node, NVLink and
inter-node bandwidth per direction and collective latency, achievable HBM rate, dense peak and a
GEMM efficiency curve, kernel-launch overhead per layer and host overhead per decode step) and
either leave ``layers`` empty (the cost model then uses ``analytic_layer_table``, the roofline of
those constants) or paste tables from this profiler run on one node of that cluster (each entry:
``shape`` hidden/ffn/heads/groups/swiglu, ``fwd_s``/``bwd_s`` {T: [[tokens, s], ...]},
``decode_s`` {T: [[sequences, s], ...]}). ``validate_profile`` names any malformed field.
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
from pathlib import Path
from typing import List, Optional

REPO = Path(__file__).resolve().parents[2]

#: prompt tokens of every decode measurement
DECODE_PROMPT_LEN = 8

#: named shape sets (the tiny PPO run of examples/run_ppo_tiny.sh)
SHAPES = {
    "tiny": dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                 swiglu=True, seq_length=64, vocab_size=259),
}


def _pow2_list(text: str, what: str) -> List[int]:
    from puzzle.config_flags import ArgumentError

    try:
        vals = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        vals = []
    if not vals or any(v < 1 for v in vals):
        raise ArgumentError(f"{what}: expected positive integers, got {text!r}")
    return vals


def build_parser() -> argparse.ArgumentParser:
    from puzzle.arguments import RaisingArgumentParser

    ap = RaisingArgumentParser(prog="python -m puzzle.tools.profile", allow_abbrev=False,
                               description="Profile per-layer and collective times into a plan-search profile JSON.")
    ap.add_argument("--out", required=True, help="profile JSON to write")
    ap.add_argument("--name", default=None, help="profile name (default: cpu-<procs>ranks or the GPU name)")
    ap.add_argument("--shapes", choices=sorted(SHAPES), default=None, help="a named shape set instead of model flags")
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--hidden-size", type=int, default=64)
    ap.add_argument("--ffn-hidden-size", type=int, default=None)
    ap.add_argument("--num-attention-heads", type=int, default=4)
    ap.add_argument("--num-query-groups", type=int, default=None)
    ap.add_argument("--group-query-attention", action="store_true", help="accepted for train_ppo.py compatibility")
    ap.add_argument("--swiglu", action="store_true")
    ap.add_argument("--seq-length", type=int, default=64)
    ap.add_argument("--vocab-size", type=int, default=259, help="tokenizer vocabulary (ByteLevelTokenizer: 259)")
    ap.add_argument("--tp-sizes", default="1,2", help="tensor-parallel degrees (powers of two)")
    ap.add_argument("--micro-batch-sizes", default="1,2,4")
    ap.add_argument("--seq-lengths", default=None, help="default: half and all of --seq-length")
    ap.add_argument("--decode-batch-sizes", default="1,2,4,8")
    ap.add_argument("--procs", type=int, default=None, help="ranks sharing this host (default: the largest T)")
    ap.add_argument("--repeats", type=int, default=15, help="timed repetitions per point (after one warm-up; 5 proved too noisy on a shared CPU)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="rounds the repetitions are spread over, every point sampled in each (default: repeats / 3)")
    ap.add_argument("--decode-steps", type=int, default=16, help="generated tokens per decode measurement")
    ap.add_argument("--timeout", type=int, default=600)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: the spec JSON of a worker
    return ap


def spec_from_args(args) -> dict:
    shape = dict(SHAPES[args.shapes]) if args.shapes else dict(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size or 4 * args.hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups or args.num_attention_heads, swiglu=args.swiglu,
        seq_length=args.seq_length, vocab_size=args.vocab_size)
    from puzzle.config_flags import ArgumentError
    from puzzle.parallel.plan import ParallelPlan

    tps = _pow2_list(args.tp_sizes, "--tp-sizes")
    if any(t & (t - 1) for t in tps):
        raise ArgumentError(f"--tp-sizes: must be powers of two, got {tps}")
    seqs = _pow2_list(args.seq_lengths, "--seq-lengths") if args.seq_lengths else sorted(
        {max(8, shape["seq_length"] // 2), shape["seq_length"]})
    if max(seqs) > shape["seq_length"]:
        raise ArgumentError(f"--seq-lengths: {seqs} exceed --seq-length {shape['seq_length']}")
    procs = args.procs or max(tps)
    if any(procs % t for t in tps):
        raise ArgumentError(f"--procs: {procs} must be a multiple of every T in {tps}")
    for t in tps:  # the model must split at every T, before any worker starts
        ParallelPlan(1, procs // t, t).check_model(
            num_layers=shape["num_layers"], num_attention_heads=shape["num_attention_heads"],
            num_query_groups=shape["num_query_groups"], ffn_hidden_size=shape["ffn_hidden_size"],
            hidden_size=shape["hidden_size"], what="--tp-sizes: the model")
    return {"shape": shape, "tp_sizes": tps, "micro_batch_sizes": _pow2_list(args.micro_batch_sizes, "--micro-batch-sizes"),
            "seq_lengths": seqs, "decode_batch_sizes": _pow2_list(args.decode_batch_sizes, "--decode-batch-sizes"),
            "procs": procs, "repeats": max(1, args.repeats), "rounds": args.rounds,
            "decode_steps": max(2, args.decode_steps), "name": args.name}


# ---- the driver (no torch.distributed here) ------------------------------------------------------
def merge_raw(raws: List[dict]) -> dict:
    """One set of raw results from several profiling worlds of the same spec: every measured time
    (the ``*_s`` fields of the training and decode points, collective times, GEMM and copy rates)
    is the mean of the worlds' medians. Taken apart in time, e.g. around the run a profile is
    compared with, they see the machine at the same speeds as that run."""
    if not raws:
        raise ValueError("merge_raw: no raw results")
    mean = statistics.fmean
    out = dict(raws[0])
    for part in ("train", "decode"):
        out[part] = {T: [dict(row, **{k: mean(r[part][T][i][k] for r in raws) for k in row if k.endswith("_s")})
                         for i, row in enumerate(rows)] for T, rows in raws[0][part].items()}
    for k in ("allreduce", "p2p"):
        out[k] = [[b, mean(r[k][i][1] for r in raws)] for i, (b, _) in enumerate(raws[0][k])]
    out["allreduce_by_ranks"] = {T: [[b, mean(r["allreduce_by_ranks"][T][i][1] for r in raws)]
                                     for i, (b, _) in enumerate(rows)]
                                 for T, rows in raws[0].get("allreduce_by_ranks", {}).items()}
    for k in ("peak_flops", "gemm_half_flops", "hbm_bandwidth"):
        out[k] = mean(r[k] for r in raws)
    if all("background_load" in r for r in raws):
        out["background_load"] = round(mean(r["background_load"] for r in raws), 2)
    out["wall_s"] = round(sum(r.get("wall_s", 0.0) for r in raws), 1)
    out["worlds"] = len(raws)
    return out


def save_built_profile(spec: dict, raw: dict, out: str, log=print):
    """Build the profile of ``raw`` (one world's or :func:`merge_raw`'s) and write it to ``out``."""
    prof = build_profile(spec, raw)
    from puzzle.plan_search.profile_data import save_profile

    save_profile(prof, out)
    log(f"wrote {out} ({raw['wall_s']} s): {len(prof.layers)} layer table(s), T={spec['tp_sizes']}, "
        f"allreduce {prof.intra_node_latency_s * 1e6:.0f} us + bytes/{prof.intra_node_bandwidth / 1e9:.2f} GB/s")
    return prof


def measure_raw(spec: dict, timeout: int = 600) -> dict:
    """Spawn the measurement world; its raw results (rank 0's medians over ranks)."""
    with tempfile.TemporaryDirectory(prefix="puzzle-profile-") as tmp:
        spec_path, res_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "result.json")
        Path(spec_path).write_text(json.dumps(dict(spec, result=res_path)))
        env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
                   PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        if spec["procs"] == 1:
            cmd = [sys.executable, "-m", "puzzle.tools.profile", "--out", "-", "--worker", spec_path]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={spec['procs']}",
                   "-m", "puzzle.tools.profile", "--out", "-", "--worker", spec_path]
        t0, background = time.perf_counter(), os.getloadavg()[0]  # the host's other work, before ours starts
        proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not os.path.exists(res_path):
            tail = "\n".join((proc.stdout + "\n" + proc.stderr).splitlines()[-40:])
            raise RuntimeError(f"profiler world failed (rc={proc.returncode}):\n{tail}")
        raw = json.loads(Path(res_path).read_text())
    raw["wall_s"] = round(time.perf_counter() - t0, 1)
    raw["background_load"] = round(background, 2)
    return raw


def run_profile(spec: dict, out: str, timeout: int = 600, log=print) -> dict:
    """Spawn the measurement world, build the profile, write ``out``; returns the raw results."""
    raw = measure_raw(spec, timeout)
    save_built_profile(spec, raw, out, log)
    return raw


def _fit_latency_bw(points, factor: float):
    """Least squares t = a + factor * bytes * c -> (latency a >= 0, bandwidth 1/c)."""
    xs = [factor * b for b, _ in points]
    ys = [t for _, t in points]
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    c = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    c = max(c, 1e-12)
    a = max(my - c * mx, 0.0)
    return a, 1.0 / c


def _fitted_collectives(spec: dict, raw: dict, to_bf16: float):
    """(all-reduce latency over pairs, its bandwidth per bf16 byte, the latency per larger group
    size, a note for the profile's comment) from the worker's collective timings."""
    if not raw.get("allreduce"):
        return 5e-5, 1e10, {}, "collectives not measured (one rank): placeholder 50 us, 10 GB/s"
    lat, bw = _fit_latency_bw(raw["allreduce"], 1.0)
    p2p_lat, p2p_bw = _fit_latency_bw(raw["p2p"], 1.0)
    bw, p2p_bw = bw * to_bf16, p2p_bw * to_bf16
    # latency of each larger group (its fitted intercept; the ring's bytes term 2(n-1)/n)
    by_ranks = {2: lat, **{int(T): _fit_latency_bw(pts, 2.0 * (int(T) - 1) / int(T))[0]
                           for T, pts in raw.get("allreduce_by_ranks", {}).items()}}
    note = (f"all-reduce (pairs, {spec['procs']} ranks busy) {lat * 1e6:.0f} us + bytes/{bw / 1e9:.3f} GB/s"
            + "".join(f", over {n} ranks {v * 1e6:.0f} us" for n, v in sorted(by_ranks.items()) if n > 2)
            + f"; p2p send/recv {p2p_lat * 1e6:.0f} us + bytes/{p2p_bw / 1e9:.3f} GB/s (per bf16 byte)")
    return lat, bw, by_ranks, note


def build_profile(spec: dict, raw: dict):
    """Profile from the worker's raw measurements (see the module docstring for the attribution)."""
    from puzzle.parallel.plan import ParallelPlan
    from puzzle.model_shape import ModelShape
    from puzzle.plan_search.cost_model import CostModel, ModelRole, PPOWorkload
    from puzzle.plan_search.profile_data import LayerTable, Profile

    sh = spec["shape"]
    elt = raw["elem_bytes"]  # bytes per element of the measured run (4 on CPU fp32)
    to_bf16 = 2.0 / elt
    lat, bw, by_ranks, comm_note = _fitted_collectives(spec, raw, to_bf16)
    hw = dict(device_memory_bytes=int(raw["device_memory_bytes"]), memory_reserved_bytes=int(raw["reserved_bytes"]),
              ranks_per_node=int(raw["ranks_per_node"]), intra_node_bandwidth=bw, inter_node_bandwidth=bw,
              intra_node_latency_s=lat, inter_node_latency_s=lat, hbm_bandwidth=float(raw["hbm_bandwidth"]),
              peak_flops=float(raw["peak_flops"]), gemm_efficiency=1.0,
              gemm_half_efficiency_flops=float(raw["gemm_half_flops"]), layer_overhead_s=1e-6,
              decode_step_overhead_s=0.0)
    prof = Profile(name=spec.get("name") or raw["device_name"], comment="", **hw,
                   host_cores=float(raw.get("host_cores", 0)),
                   host_background_load=float(raw.get("background_load", 0.0)) if raw.get("host_cores") else 0.0,
                   allreduce_latency_s_by_ranks={n: float(f"{v:.4g}") for n, v in by_ranks.items()} if len(by_ranks) > 1 else {})
    shape = ModelShape(sh["num_layers"], sh["hidden_size"], sh["ffn_hidden_size"], sh["num_attention_heads"],
                       sh["num_query_groups"], raw["padded_vocab"], sh["swiglu"])
    role = ModelRole("actor", shape, True, True)
    L = sh["num_layers"]
    cm = CostModel(prof, PPOWorkload(1))
    fwd, bwd, dec = {}, {}, {}
    floor = []
    for T in spec["tp_sizes"]:
        rows_f, rows_b = {}, {}
        for m in raw["train"][str(T)]:
            tok = m["tokens"]
            head = cm._head_fwd(role, tok, T)
            ar = 2 * prof.allreduce_time(tok * sh["hidden_size"] * 2, T, False)  # what the cost model adds per layer
            floor_f = 0.1 * max(m["layer_fwd_s"], 1e-6)
            f = max((m["fwd_s"] - head) / L - ar, floor_f)
            b = max((m["bwd_s"] - 2 * head) / L - ar, floor_f)
            rows_f.setdefault(tok, []).append(f)
            rows_b.setdefault(tok, []).append(b)
            floor.append(m["layer_fwd_s"])
        fwd[T] = [(float(t), float(f"{statistics.median(v):.4g}")) for t, v in sorted(rows_f.items())]
        bwd[T] = [(float(t), float(f"{statistics.median(v):.4g}")) for t, v in sorted(rows_b.items())]
        dec[T] = [(float(d["seqs"]), float(f"{max(d['layer_s'] - d['layer_comm_s'], 1e-7):.4g}"))
                  for d in raw["decode"][str(T)]]
    prof.layer_overhead_s = float(f"{min(floor):.4g}")
    prof.layers[(sh["hidden_size"], sh["ffn_hidden_size"], sh["num_attention_heads"], sh["num_query_groups"],
                 bool(sh["swiglu"]))] = LayerTable(
        name=f"L{L}-h{sh['hidden_size']}-f{sh['ffn_hidden_size']}-a{sh['num_attention_heads']}-g{sh['num_query_groups']}",
        hidden_size=sh["hidden_size"], ffn_hidden_size=sh["ffn_hidden_size"],
        num_attention_heads=sh["num_attention_heads"], num_query_groups=sh["num_query_groups"],
        swiglu=bool(sh["swiglu"]), seq_len=max(spec["seq_lengths"]), fwd_s=fwd, bwd_s=bwd, decode_s=dec)
    # host overhead of a decode step: the measured step minus the decode step the cost model itself
    # estimates from the tables above at the measured point (P = 1: layers, their TP all-reduces,
    # KV read, LM head, vocab-parallel sampling exchange): per T the median over its batch sizes
    # (the embedding's and the sampling's other collectives grow with T), and the median over
    # every T and batch size (the scalar, for other T)
    over = {}
    for T in spec["tp_sizes"]:
        for d in raw["decode"][str(T)]:
            w = PPOWorkload(int(d["seqs"]), prompt_len=DECODE_PROMPT_LEN, gen_len=spec["decode_steps"])
            modelled = CostModel(prof, w).generation_cost(role, ParallelPlan(1, 1, T)).t_stage
            over.setdefault(T, []).append(d["step_s"] - modelled)
    prof.decode_step_overhead_s = float(f"{max(statistics.median(sum(over.values(), [])), 0.0):.4g}")
    if len(over) > 1:
        prof.decode_step_overhead_s_by_tp = {T: float(f"{max(statistics.median(v), 0.0):.4g}") for T, v in over.items()}
    prof.comment = (
        f"Measured by `python -m puzzle.tools.profile` on {raw['device_name']} with {spec['procs']} ranks on this host "
        f"(torch {raw['torch']}, {raw['dtype']}, OMP_NUM_THREADS={raw['omp']}), {raw['wall_s']} s. Layer tables: whole "
        f"{L}-layer GPTModel micro-batch fwd/bwd with the PPO log-prob loss, minus the cost model's LM-head and per-layer "
        f"TP all-reduce estimates, per layer (layers + their share of per-micro-batch fixed costs; exact for {L} layers); decode: per-layer "
        f"share of a generate() decode step (hooks), decode_step_overhead_s(_by_tp) = rest of the step (per T). {comm_note}. "
        f"GEMM peak {raw['peak_flops'] / 1e9:.1f} GFLOP/s, memory copy {raw['hbm_bandwidth'] / 1e9:.1f} GB/s. "
        f"One host: inter-node figures = intra-node"
        + (f"; its {prof.host_cores:g} cores shared by the {spec['procs']} ranks beside a background load of "
           f"{prof.host_background_load:g} (the load average before they started)" if prof.host_cores else "")
        + ". See puzzle/tools/profile.py.")
    return prof


# ---- the worker (inside the torchrun world) ------------------------------------------------------
class _CommTimer:
    """Times torch.distributed collectives (and p2p) while installed; megatron calls them through the
    torch.distributed module attributes, so wrapping those attributes sees every TP collective."""

    NAMES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "_all_gather_base",
             "_reduce_scatter_base", "all_gather", "broadcast")

    def __init__(self):
        self.total = 0.0
        self._orig = {}

    def __enter__(self):
        import torch.distributed as dist

        for n in self.NAMES:
            f = getattr(dist, n, None)
            if f is None:
                continue
            self._orig[n] = f

            def wrap(*a, _f=f, **k):
                t = time.perf_counter()
                try:
                    return _f(*a, **k)
                finally:
                    self.total += time.perf_counter() - t
            setattr(dist, n, wrap)
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist

        for n, f in self._orig.items():
            setattr(dist, n, f)
        self._orig.clear()
        return False


class _LayerHooks:
    """Forward time of every transformer layer call (and the collective time inside it)."""

    def __init__(self, layers, comm: _CommTimer):
        self.layers, self.comm = layers, comm
        self.calls: List[tuple] = []  # (seq dim of the input, seconds, comm seconds)
        self._h = []
        self._t = None

    def __enter__(self):
        for layer in self.layers:
            self._h.append(layer.register_forward_pre_hook(self._pre, with_kwargs=True))
            self._h.append(layer.register_forward_hook(self._post))
        return self

    def _pre(self, module, args, kwargs):
        hs = args[0] if args else kwargs.get("hidden_states")
        self._t = (time.perf_counter(), self.comm.total, int(hs.shape[0]))

    def _post(self, module, args, out):
        t0, c0, s = self._t
        self.calls.append((s, time.perf_counter() - t0, self.comm.total - c0))

    def __exit__(self, *exc):
        for h in self._h:
            h.remove()
        self._h.clear()
        return False


def _sync(dev):
    import torch

    if dev.type != "cpu":
        torch.cuda.synchronize()


def _hardware(dev, dtype) -> dict:
    import torch

    def rate(n, k=None, reps=5):
        k = k or n
        a, b = torch.randn(n, k, dtype=dtype, device=dev), torch.randn(k, n, dtype=dtype, device=dev)
        a @ b
        _sync(dev)
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            a @ b
            _sync(dev)
            ts.append(time.perf_counter() - t)
        return 2.0 * n * n * k / statistics.median(ts)

    big = 4096 if dev.type != "cpu" else 512
    peak = max(rate(big), rate(big // 2))
    small_f = 2.0 * 64 * 64 * 64
    r_small = rate(64)
    half = max(small_f * (peak / r_small - 1.0), 1.0)
    x = torch.empty(16 * 2 ** 20 if dev.type == "cpu" else 256 * 2 ** 20, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    y.copy_(x)
    ts = []
    for _ in range(5):
        _sync(dev)
        t = time.perf_counter()
        y.copy_(x)
        _sync(dev)
        ts.append(time.perf_counter() - t)
    hbm = 2.0 * x.numel() / statistics.median(ts)  # read + write
    return {"peak_flops": peak, "gemm_half_flops": half, "hbm_bandwidth": hbm}


class _Collectives:
    """All-reduce and send/recv over pairs (0,1), (2,3), ... all at once, per message size, and
    all-reduce over the groups of every larger T of ``group_sizes`` (the TP groups of (1, world/T,
    T), all at once); sampled in the worker's rounds like every other point (medians over all
    rounds)."""

    SIZES = (256, 4096, 65536, 262144)

    def __init__(self, dev, dtype, rank: int, world: int, group_sizes=()):
        import torch
        import torch.distributed as dist

        self.dev, self.rank, self.mine = dev, rank, None
        self.esz = torch.tensor([], dtype=dtype).element_size()
        self.bufs = {n: torch.ones(n, dtype=dtype, device=dev) for n in self.SIZES} if world >= 2 else {}
        for p in ([2 * i, 2 * i + 1] for i in range(world // 2)):
            g = dist.new_group(p)
            if rank in p:
                self.mine = (g, p)
        self.groups = {}  # T -> this rank's group of T ranks
        for T in sorted(t for t in group_sizes if 2 < t <= world and world % t == 0):
            for i in range(world // T):
                g = dist.new_group(list(range(i * T, (i + 1) * T)))
                if i == rank // T:
                    self.groups[T] = g
        self.ar = {n: [] for n in self.bufs}
        self.pp = {n: [] for n in self.bufs}
        self.ar_groups = {T: {n: [] for n in self.bufs} for T in self.groups}

    def sample(self, reps: int, keep: bool) -> None:
        import torch.distributed as dist

        for T, g in self.groups.items():
            for n, x in self.bufs.items():
                dist.barrier()
                self._time_allreduce(x, g, reps, self.ar_groups[T][n] if keep else None)
        for n, x in self.bufs.items():
            dist.barrier()
            if self.mine is None:
                continue
            g, p = self.mine
            self._time_allreduce(x, g, reps, self.ar[n] if keep else None)
            for _ in range(reps):
                _sync(self.dev)
                t = time.perf_counter()
                if self.rank == p[0]:
                    dist.send(x, p[1])
                    dist.recv(x, p[1])
                else:
                    dist.recv(x, p[0])
                    dist.send(x, p[0])
                _sync(self.dev)
                if keep:
                    self.pp[n].append((time.perf_counter() - t) / 2)  # one direction of a ping-pong

    def _time_allreduce(self, x, group, reps: int, into) -> None:
        """``reps`` all-reduces of ``x`` over ``group``, each timed alone (device synced) and
        appended to ``into`` (None: a warm-up, not kept)."""
        import torch.distributed as dist

        for _ in range(reps):
            _sync(self.dev)
            t = time.perf_counter()
            dist.all_reduce(x, group=group)
            _sync(self.dev)
            if into is not None:
                into.append(time.perf_counter() - t)

    def results(self) -> dict:
        if self.mine is None:
            return {"allreduce": [], "p2p": [], "allreduce_by_ranks": {}}
        return {"allreduce": [[n * self.esz, statistics.median(self.ar[n])] for n in self.bufs],
                "p2p": [[n * self.esz, statistics.median(self.pp[n])] for n in self.bufs],
                "allreduce_by_ranks": {str(T): [[n * self.esz, statistics.median(v[n])] for n in self.bufs]
                                       for T, v in self.ar_groups.items()}}


class _TPoints:
    """The measurement points of one tensor-parallel degree T: its engine (layout (1, world/T, T))
    and inputs, and one timed sample of a point per call, so that the worker can take every
    point's samples in rounds spread over the whole profiling time."""

    def __init__(self, spec, T, world, dev, comm: _CommTimer):
        import torch

        from puzzle.config import ModelArch
        from puzzle.parallel.groups import layout_for
        from puzzle.parallel.plan import ParallelPlan
        from puzzle.engine.model_engine import ModelEngine

        sh = spec["shape"]
        self.spec, self.sh, self.dev, self.comm = spec, sh, dev, comm
        arch = ModelArch.llama(num_layers=sh["num_layers"], hidden_size=sh["hidden_size"],
                               ffn_hidden_size=sh["ffn_hidden_size"], num_attention_heads=sh["num_attention_heads"],
                               num_query_groups=sh["num_query_groups"], vocab_size=sh["vocab_size"],
                               seq_length=sh["seq_length"], swiglu=sh["swiglu"])
        self.padded_vocab = arch.padded_vocab_size
        self.layout = layout_for(ParallelPlan(1, world // T, T))
        self.eng = ModelEngine("actor", arch, self.layout, trainable=True)
        self.layers = list(self.eng.module.decoder.layers)
        gen = torch.Generator().manual_seed(1234 + self.layout.d)
        self.train_inputs = []
        for s in spec["seq_lengths"]:
            for b in spec["micro_batch_sizes"]:
                ids = torch.randint(0, sh["vocab_size"], (b, s), generator=gen).to(dev)
                self.train_inputs.append((b, s, ids, torch.arange(s, device=dev).unsqueeze(0).expand(b, s)))
        prompt = DECODE_PROMPT_LEN
        self.decode_prompts = [[[int(v) for v in torch.randint(3, sh["vocab_size"], (prompt,), generator=gen)]
                                for _ in range(nb)] for nb in spec["decode_batch_sizes"]]
        self.train = [dict(f_t=[], b_t=[], f_c=[], b_c=[], lay=[]) for _ in self.train_inputs]
        self.decode = [dict(steps=[], layer=[], comm=[]) for _ in self.decode_prompts]
        self._seed = 0

    def train_sample(self, i: int, keep: bool) -> None:
        """One forward + backward of training point i (the PPO log-prob + entropy loss path)."""
        from puzzle.engine.vocab_parallel import vocab_parallel_logprobs

        _, _, ids, pos = self.train_inputs[i]
        eng, comm = self.eng, self.comm
        eng.model.train()
        hooks = _LayerHooks(self.layers, comm)
        _sync(self.dev)
        with hooks:
            c0, t0 = comm.total, time.perf_counter()
            out = eng.model(ids, pos, None)
            lp, ent = vocab_parallel_logprobs(out[:, :-1], ids[:, 1:], self.layout.tp_group, self.sh["vocab_size"],
                                              with_entropy=True)
            loss = lp.mean() + ent.mean()
            _sync(self.dev)
            c1, t1 = comm.total, time.perf_counter()
            loss.backward()
            _sync(self.dev)
            c2, t2 = comm.total, time.perf_counter()
        eng.zero_grad()
        if keep:
            r = self.train[i]
            r["f_t"].append(t1 - t0)
            r["b_t"].append(t2 - t1)
            r["f_c"].append(c1 - c0)
            r["b_c"].append(c2 - c1)
            r["lay"].append(sum(d - c for _, d, c in hooks.calls) / len(self.layers))

    def _generate(self, prompts, k: int, hooks=None) -> float:
        from puzzle.rollout.generation import generate
        from puzzle.rollout.sampling import SamplingParams

        params = SamplingParams(max_new_tokens=k, temperature=1.0, eos_id=None, pad_id=0)
        self._seed += 1
        _sync(self.dev)
        t = time.perf_counter()
        if hooks is None:
            generate(self.eng, prompts, params, seed=self._seed)
        else:
            with hooks:
                generate(self.eng, prompts, params, seed=self._seed)
        _sync(self.dev)
        return time.perf_counter() - t

    def decode_sample(self, i: int, keep: bool, barrier) -> None:
        """A pair of generate() calls of decode point i, 1 and n new tokens, back to back: the
        step time is their difference / (n - 1), so a change of machine speed between the pair's
        samples hardly moves it; the layers' share of a step from forward hooks on the n-token call."""
        n = self.spec["decode_steps"]
        prompts = self.decode_prompts[i]
        barrier()
        w1 = self._generate(prompts, 1)
        barrier()
        hooks = _LayerHooks(self.layers, self.comm)
        wn = self._generate(prompts, n, hooks)
        if keep:
            r = self.decode[i]
            r["steps"].append((wn - w1) / (n - 1))
            dcalls = [(d, c) for s, d, c in hooks.calls if s == 1]
            if dcalls:
                r["layer"].append(statistics.median(d for d, _ in dcalls))
                r["comm"].append(statistics.median(c for _, c in dcalls))

    def results(self) -> tuple:
        med = statistics.median
        train = [{"tokens": b * s, "mbs": b, "seq": s, "fwd_s": med(r["f_t"]), "bwd_s": med(r["b_t"]),
                  "fwd_comm_s": med(r["f_c"]), "bwd_comm_s": med(r["b_c"]), "layer_fwd_s": med(r["lay"])}
                 for (b, s, _, _), r in zip(self.train_inputs, self.train)]
        decode = [{"seqs": len(p), "step_s": max(med(r["steps"]), 1e-7), "layer_s": med(r["layer"]),
                   "layer_comm_s": med(r["comm"])} for p, r in zip(self.decode_prompts, self.decode)]
        return train, decode


def _rounds(spec) -> int:
    """Rounds the samples are taken in (every point gets repeats / rounds samples per round)."""
    return max(1, min(spec.get("rounds") or spec["repeats"] // 3, spec["repeats"]))


def _measure(spec, world, rank, dev, dtype, comm: _CommTimer) -> tuple:
    """Every point of every T, sampled in rounds: round r takes ~repeats/rounds samples of each
    point in turn, so each point's median spans the whole profiling time, not a few seconds of it
    (a shared machine changes speed over seconds). All ranks start each sample together (a
    barrier), as the ranks of a run are busy together; one untimed warm-up sample per point first."""
    import torch.distributed as dist

    coll = _Collectives(dev, dtype, rank, world, spec["tp_sizes"])
    points = {T: _TPoints(spec, T, world, dev, comm) for T in spec["tp_sizes"]}
    reps, rounds = spec["repeats"], _rounds(spec)
    per_round = -(-reps // rounds)                   # samples of a point per round
    dec_round = -(-max(2, reps // 2) // rounds)       # decode pairs of a point per round
    coll_round = max(per_round, 5 // rounds + 1)      # collectives: at least 5 samples in all
    for r in range(-1, rounds):                       # r = -1: one untimed warm-up sample each
        coll.sample(1 if r < 0 else coll_round, keep=r >= 0)
        for T, pts in points.items():
            for i in range(len(pts.train_inputs)):
                for _ in range(1 if r < 0 else per_round):
                    dist.barrier()
                    pts.train_sample(i, keep=r >= 0)
            for i in range(len(pts.decode_prompts)):
                for _ in range(1 if r < 0 else dec_round):
                    pts.decode_sample(i, keep=r >= 0, barrier=dist.barrier)
    out = {T: pts.results() for T, pts in points.items()}
    return ({str(T): o[0] for T, o in out.items()}, {str(T): o[1] for T, o in out.items()},
            next(iter(points.values())).padded_vocab, coll.results())


def worker(spec_path: str) -> None:
    import megatron_patches

    megatron_patches.apply()
    import torch
    import torch.distributed as dist

    from puzzle.parallel.groups import destroy_layouts, init_distributed

    spec = json.loads(Path(spec_path).read_text())
    rank, world = init_distributed()
    from puzzle.parallel.device import runtime

    dev = runtime().device
    dtype = torch.bfloat16 if dev.type != "cpu" else torch.float32
    try:
        import resource

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    except Exception:  # pragma: no cover
        rss = 2 ** 30
    hw = _hardware(dev, dtype)
    comm = _CommTimer()
    with comm:
        train, decode, padded, comm_raw = _measure(spec, world, rank, dev, dtype, comm)
    dist.barrier()
    # every rank measured; rank 0 reports the medians over ranks (one figure per point)
    gathered = [None] * world
    dist.all_gather_object(gathered, {"train": train, "decode": decode, "hw": hw, "comm": comm_raw})
    if rank == 0:
        def med_rows(rows_per_rank):
            out = []
            for i, row in enumerate(rows_per_rank[0]):
                m = dict(row)
                for k, v in row.items():
                    if k.endswith("_s"):
                        m[k] = statistics.median(r[i][k] for r in rows_per_rank)
                out.append(m)
            return out

        res = {
            "train": {T: med_rows([g["train"][T] for g in gathered]) for T in train},
            "decode": {T: med_rows([g["decode"][T] for g in gathered]) for T in decode},
            "peak_flops": statistics.median(g["hw"]["peak_flops"] for g in gathered),
            "gemm_half_flops": statistics.median(g["hw"]["gemm_half_flops"] for g in gathered),
            "hbm_bandwidth": statistics.median(g["hw"]["hbm_bandwidth"] for g in gathered),
            "allreduce": [[b, statistics.median(g["comm"]["allreduce"][i][1] for g in gathered if g["comm"]["allreduce"])]
                          for i, (b, _) in enumerate(comm_raw["allreduce"])],
            "p2p": [[b, statistics.median(g["comm"]["p2p"][i][1] for g in gathered if g["comm"]["p2p"])]
                    for i, (b, _) in enumerate(comm_raw["p2p"])],
            "allreduce_by_ranks": {T: [[b, statistics.median(g["comm"]["allreduce_by_ranks"][T][i][1] for g in gathered)]
                                       for i, (b, _) in enumerate(rows)]
                                   for T, rows in comm_raw.get("allreduce_by_ranks", {}).items()},
            "elem_bytes": torch.tensor([], dtype=dtype).element_size(), "padded_vocab": padded,
            "device_name": (torch.cuda.get_device_name() if dev.type != "cpu" else f"cpu-{os.cpu_count()}cores-{world}ranks"),
            "device_memory_bytes": (torch.cuda.get_device_properties(dev).total_memory if dev.type != "cpu"
                                    else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // world),
            "host_cores": len(os.sched_getaffinity(0)) if dev.type == "cpu" else 0,  # (GPUs: a device each)
            "reserved_bytes": rss, "ranks_per_node": world, "torch": torch.__version__, "dtype": str(dtype),
            "omp": os.environ.get("OMP_NUM_THREADS", "unset"),
        }
        Path(spec["result"]).write_text(json.dumps(res))
    dist.barrier()
    destroy_layouts()
    dist.destroy_process_group()


def main(argv: Optional[List[str]] = None) -> int:
    """Bad input: one ``error:`` line and exit status 2 (as train_ppo.py), before any worker starts."""
    from puzzle.fail_fast import run_failing_fast

    return run_failing_fast(_profile, argv)


def _profile(argv: Optional[List[str]]) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0
    spec = spec_from_args(args)
    run_profile(spec, args.out, timeout=args.timeout)
    return 0


if __name__ == "__main__":
    from puzzle.parallel import launcher

    launcher.exit_process(main())
