"""Benchmark and check (GPU): packed attention as one flash-attention varlen call against one SDPA
call per distinct length.

    python -m puzzle.bench.packed_attention [--cap 2048] [--rows 16] [--repeats 10]

One micro-batch of ``--rows`` packed sequences with long-tailed lengths (puzzle.bench.packing's
distribution: exponential, mean/max ~0.2, one row at ``--cap``), the attention of a ~1.1B LLaMA
layer (32 query heads, 4 key/value heads, head dim 64), bf16, causal within each sequence. Both
paths run forward and backward on the same tensors; the JSON row gives the largest difference of
the outputs and of the three gradients against the per-length path, and the median seconds of
each path over ``--repeats`` (after a warm-up), with their ratio measured in this one run.
Needs a CUDA device whose flash kernel applies (``varlen_flash_usable``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

HEADS, GROUPS, HEAD_DIM = 32, 4, 64


def _time(fn, repeats: int) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _forward_backward(attend, q, k, v, grad_out):
    import torch

    out = attend(q, k, v)
    return out, torch.autograd.grad(out, (q, k, v), grad_out)


def run(cap: int, rows: int, repeats: int) -> dict:
    import torch

    from puzzle.bench.packing import response_lengths
    from puzzle.models.packed_attention import (PackedSequences, packed_attention, varlen_flash_attention,
                                                varlen_flash_usable)
    from puzzle.models.sdpa_attention import sdpa_attention
    from puzzle.parallel.device import local_device

    device = local_device()
    if device.type != "cuda":
        raise SystemExit("error: puzzle.bench.packed_attention needs a CUDA device (found none)")
    lengths = response_lengths("long_tailed", rows, cap).tolist()
    packed = PackedSequences.of(lengths, device=device)
    g = torch.Generator(device=device).manual_seed(0)
    T, scale = sum(lengths), 1.0 / math.sqrt(HEAD_DIM)
    q, k, v = (torch.randn(T, n, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
               for n in (HEADS, GROUPS, GROUPS))
    if not varlen_flash_usable(q, k, 0.0):
        raise SystemExit(f"error: the flash varlen kernel does not apply on {torch.cuda.get_device_name()}")
    grad_out = torch.randn(T, HEADS * HEAD_DIM, device=device, dtype=torch.bfloat16, generator=g)

    def per_length(q_, k_, v_):
        return packed_attention(lambda a, b, c: sdpa_attention(a, b, c, None, a.shape[0] > 1, scale),
                                q_, k_, v_, packed)

    def one_call(q_, k_, v_):
        return varlen_flash_attention(q_, k_, v_, packed, scale)

    ref_out, ref_grads = _forward_backward(per_length, q, k, v, grad_out)
    out, grads = _forward_backward(one_call, q, k, v, grad_out)
    diffs = {name: float((a.float() - b.float()).abs().max())
             for name, a, b in zip(("out", "dq", "dk", "dv"), (out,) + grads, (ref_out,) + ref_grads)}
    t_per_length = _time(lambda: _forward_backward(per_length, q, k, v, grad_out), repeats)
    t_one_call = _time(lambda: _forward_backward(one_call, q, k, v, grad_out), repeats)
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": T, "rows": rows,
            "distinct_lengths": len(set(lengths)), "cap": cap, "max_abs_diff": diffs,
            "per_length_s": round(t_per_length, 6), "one_call_s": round(t_one_call, 6),
            "per_length_over_one_call": round(t_per_length / t_one_call, 3)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m puzzle.bench.packed_attention", description=__doc__.split("\n")[0])
    ap.add_argument("--cap", type=int, default=2048, help="longest sequence (tokens)")
    ap.add_argument("--rows", type=int, default=16, help="sequences in the micro-batch")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args(argv)
    json.dump(run(args.cap, args.rows, args.repeats), sys.stdout)
    print()


if __name__ == "__main__":
    main()
