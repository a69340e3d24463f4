"""CUDA graphs for the decode step (``--cuda-graph-generation``; CUDA device, generation P=1).

A decode step over slots 0..n-1 runs as the graph of the smallest batch-size bucket N >= n
(``graph_buckets``): the step's token ids and positions are copied into static buffers, rows
n..N-1 (finished or free slots) compute values nobody reads, and every row attends over the
cache's whole width with its mask, so one graph serves every step of that bucket.

A graph is tied to the KV-cache buffers it was captured with. ``DecodeGraphs`` (one per model)
keeps one static cache of (slots, width), the width rounded up to a multiple of
``WIDTH_MULTIPLE``, and its graphs, and reuses them for every generation of the same shape (the
next PPO iteration's). Weights updated in place (the switch copies into the same parameters)
need no recapture.

Capture happens at a bucket's first use, with that step's real inputs: the warm-up runs and the
captured run write the same keys and values to the same cache positions, so capturing changes
nothing; the graph is then replayed for the step's output.
"""

from __future__ import annotations

import bisect
from typing import Dict, List, Tuple

import torch

WIDTH_MULTIPLE = 64


def graph_buckets(max_batch: int) -> List[int]:
    """Batch sizes graphs are captured for: 1, 2, 4, 8, multiples of 8 up to 64, of 32 above,
    and ``max_batch`` itself (so every n in 1..max_batch has a bucket)."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1 (got {max_batch})")
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(96, max_batch + 1, 32))
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


def bucket_for(n: int, buckets: List[int]) -> int:
    """The smallest bucket >= n."""
    i = bisect.bisect_left(buckets, n)
    if n < 1 or i == len(buckets):
        raise ValueError(f"no CUDA-graph bucket for a batch of {n} (buckets {buckets})")
    return buckets[i]


def graph_width(width: int) -> int:
    """Cache width of a graphed generation: ``width`` rounded up to WIDTH_MULTIPLE."""
    return -(-width // WIDTH_MULTIPLE) * WIDTH_MULTIPLE


class DecodeGraphs:
    """The static cache, input buffers and captured decode graphs of one model."""

    def __init__(self, device: torch.device, capture: bool = True):
        """``capture=False`` runs the same static-shape bucketed step without a graph (any
        device): the check of everything but the capture itself."""
        self.device, self.capture = device, capture
        self.key: Tuple[int, int] = (0, 0)
        self.width = 0
        self._cache = None
        self.graphs: Dict[int, tuple] = {}
        self.captures = 0
        self.pool = None
        self.rope_tables = None  # (cos, sin) the graphs read: kept with them

    @classmethod
    def for_model(cls, model, P: int, device: torch.device) -> "DecodeGraphs":
        if P != 1:
            raise ValueError(f"--cuda-graph-generation needs a generation layout with P=1 (got P={P})")
        graphs = getattr(model, "_puzzle_decode_graphs", None)
        if graphs is None:
            if device.type != "cuda":
                raise ValueError(f"--cuda-graph-generation needs a CUDA device (the model is on {device})")
            graphs = cls(device)
            model._puzzle_decode_graphs = graphs
        return graphs

    def cache(self, slots: int, width: int):
        """The static cache for ``slots`` rows and at least ``width`` positions (kept if the
        shape is the one of the last generation, with its graphs)."""
        from puzzle.models.sdpa_attention import StaticKVCache

        key = (slots, graph_width(width))
        if key != self.key or self._cache is None:
            self.key, self.width = key, key[1]
            self._cache = StaticKVCache(slots, self.width)
            self.graphs = {}
            self.rope_tables = None
            self.buckets = graph_buckets(slots)
            self.ids = torch.zeros(slots, dtype=torch.long, device=self.device)
            self.pos = torch.zeros(slots, dtype=torch.long, device=self.device)
            if self.pool is None and self.capture:
                self.pool = torch.cuda.graph_pool_handle()
        return self._cache

    def keep_rope_tables(self, hooks) -> None:
        """The graphs read the RoPE tables of their capture: later generations use those."""
        if self.rope_tables is None:
            self.rope_tables = (hooks.cos, hooks.sin)
        else:
            hooks.cos, hooks.sin = self.rope_tables

    def decode(self, sb, run) -> torch.Tensor:
        """Logits [n, V/T] of the decode call ``sb.call``, from the graph of its bucket."""
        call = sb.call
        n = call.n
        N = bucket_for(n, self.buckets)
        self.ids[:n].copy_(call.ids[:, 0])
        self.pos[:n].copy_(call.positions[:, 0])
        if N > n:
            self.ids[n:N].copy_(sb.last[n:N])
            self.pos[n:N].copy_(sb.lens[n:N])
        cache, width = sb.cache, self.width
        ids, pos = self.ids[:N], self.pos[:N]

        def step():
            cache.decode(N, pos, width)
            return run(ids.unsqueeze(1), pos.unsqueeze(1), None, None)

        if not self.capture:
            return step()[:n]
        if N not in self.graphs:
            self.graphs[N] = self._capture(step)
        graph, out = self.graphs[N]
        graph.replay()
        return out[:n]

    def _capture(self, step):
        dev = self.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = step()
        self.captures += 1
        return graph, out
