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

Whole-step graphs. Once every prompt of a generation has its slot (no prompt waits for a free
one, the usual case: one cache row per prompt), a decode step needs nothing from the host: the
model call over every slot, the sampling (``sample_tokens(graph_safe=True)``) and the state
update (lengths, step counts, last tokens, finished rows) are all tensor operations on static
buffers. ``FusedDecode`` captures that whole step as one graph (per sampling setting), replays
it ``check_every`` times between two host checks of "all rows finished", and copies the
tokens back at the end. Finished rows keep computing values nobody reads (their state no longer
changes), so the tokens equal the step-by-step loop's. ``compile`` runs the captured steps
through ``torch.compile`` (inductor fuses the elementwise work between the matrix products;
bf16 results may then round differently from the eager kernels).

MoE models: the cache here has ``static_shapes``, which switches their MoE layers to the static
step of puzzle/models/moe_decode.py (every expert on every row, weighted by the router's
probabilities) in place of megatron's token dispatchers, which read counts on the host.

Without capture (``capture=False``, any device) every step runs under ``HostSyncGuard``: an
operation that would make the host wait for the device or give a data-dependent shape (what a
CUDA graph cannot capture) raises, so such a regression fails on a CPU as well.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import sys
from typing import Dict, List, Tuple

import torch
from torch.overrides import TorchFunctionMode

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


class HostSyncError(RuntimeError):
    """An operation in a graphed decode step that waits for the device or has a data-dependent shape."""


_T = torch.Tensor
#: tensor operations that copy a value to the host or size their output by the data
_HOST_SYNCS = frozenset({
    _T.item, _T.tolist, _T.cpu, _T.numpy, _T.__bool__, _T.__int__, _T.__float__, _T.__index__,
    _T.nonzero, torch.nonzero, _T.argwhere, torch.argwhere, _T.masked_select, torch.masked_select,
    _T.unique, torch.unique, torch.unique_consecutive, _T.bincount, torch.bincount,
    _T.equal, torch.equal, _T.allclose, torch.allclose, torch.is_nonzero,
})


#: code whose tensors are host copies on a GPU too: megatron's RNG tracker compares CPU
#: generator states (its fork around megatron's unfused core attention, the CPU default)
_HOST_SIDE_CODE = (os.path.join("megatron", "core", "tensor_parallel", "random.py"),)


class HostSyncGuard(TorchFunctionMode):
    """Raises HostSyncError at each operation a CUDA graph cannot capture: a value read on the
    host (``item``, ``tolist``, ``cpu``, ``bool(t)``, ``int(t)``, ``torch.equal``...), an output
    sized by the data (``nonzero``, ``masked_select``, boolean-mask indexing, ``unique``,
    ``repeat_interleave`` by a tensor without ``output_size``). On a CPU every tensor is a host
    tensor: calls from ``_HOST_SIDE_CODE``, whose tensors stay on the host on a GPU, pass."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func in _HOST_SYNCS or _data_sized(func, args, kwargs)) \
                and not sys._getframe(1).f_code.co_filename.endswith(_HOST_SIDE_CODE):
            name = getattr(func, "__qualname__", getattr(func, "__name__", repr(func)))
            raise HostSyncError(f"{name} in a CUDA-graph decode step: it synchronises with the host "
                                f"or has a data-dependent shape, which graph capture cannot record")
        return func(*args, **kwargs)


def _data_sized(func, args, kwargs) -> bool:
    """Boolean-mask indexing (a masked write of one scalar is ``masked_fill_``: static), a
    ``repeat_interleave`` by a tensor of counts without ``output_size``."""
    if func in (_T.__getitem__, _T.__setitem__) and len(args) > 1:
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        if func is _T.__setitem__ and (isinstance(args[2], (int, float, bool)) or
                                       isinstance(args[2], torch.Tensor) and args[2].dim() == 0):
            return False  # index_put_ dispatches a masked write of a scalar to masked_fill_
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
    if func in (torch.repeat_interleave, _T.repeat_interleave):
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return isinstance(repeats, torch.Tensor) and repeats.numel() > 1 and "output_size" not in kwargs
    return False


def _check_moe_static(model) -> None:
    from puzzle.models.decode_layer import moe_static_problem

    problem = moe_static_problem(model)
    if problem is not None:
        raise ValueError(f"--cuda-graph-generation: {problem}; the graphed decode step runs every expert "
                         f"whole on each rank (expert parallelism and expert tensor parallelism 1)")


class DecodeGraphs:
    """The static cache, input buffers and captured decode graphs of one model."""

    def __init__(self, device: torch.device, capture: bool = True, host_sync_guard: bool = True):
        """``capture=False`` runs the same static-shape bucketed step without a graph (any
        device): the check of everything but the capture itself, each step under HostSyncGuard
        (``host_sync_guard=False``: without it, for timings)."""
        self.device, self.capture, self.host_sync_guard = device, capture, host_sync_guard
        self.key: Tuple[int, int] = (0, 0)
        self.width = 0
        self._cache = None
        self.graphs: Dict[int, tuple] = {}
        self.captures = 0
        self.pool = None
        self.rope_tables = None  # (cos, sin) the graphs read: kept with them
        self.compile = False     # run the captured steps through torch.compile (inductor)
        self.fused: Dict[tuple, "FusedDecode"] = {}

    @classmethod
    def for_model(cls, model, P: int, device: torch.device, compile_graphs: bool = False) -> "DecodeGraphs":
        if P != 1:
            raise ValueError(f"--cuda-graph-generation needs a generation layout with P=1 (got P={P})")
        if getattr(getattr(model, "config", None), "num_moe_experts", None):
            _check_moe_static(model)
        graphs = getattr(model, "_puzzle_decode_graphs", None)
        if graphs is None:
            if device.type != "cuda":
                raise ValueError(f"--cuda-graph-generation needs a CUDA device (the model is on {device})")
            graphs = cls(device)
            model._puzzle_decode_graphs = graphs
        if graphs.compile != compile_graphs:
            graphs.compile, graphs.key = compile_graphs, (0, 0)  # captured anew at the next cache()
        return graphs

    def cache(self, slots: int, width: int):
        """The static cache for ``slots`` rows and at least ``width`` positions (kept if the
        shape is the one of the last generation, with its graphs)."""
        from puzzle.models.sdpa_attention import StaticKVCache

        key = (slots, graph_width(width))
        if key != self.key or self._cache is None:
            self.key, self.width = key, key[1]
            self._cache = StaticKVCache(slots, self.width)
            # every step has its bucket's static shapes: MoE layers take their static step
            self._cache.static_shapes = True
            self.graphs, self.fused = {}, {}
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
            with self.guard():
                return step()[:n]
        if N not in self.graphs:
            self.graphs[N] = self._capture(step)
        graph, out = self.graphs[N]
        graph.replay()
        return out[:n]

    def guard(self):
        """The context of a step run without capture."""
        return HostSyncGuard() if self.host_sync_guard else contextlib.nullcontext()

    def _capture(self, step, before_capture=None):
        """(graph, output) of ``step``: two warm-up runs on a side stream, then the capture.
        ``before_capture`` runs between them (undoes what the warm-ups changed)."""
        dev = self.device
        if self.compile:
            step = torch.compile(step, dynamic=False)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream(dev).wait_stream(side)
        if before_capture is not None:
            before_capture()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = step()
        self.captures += 1
        return graph, out

    # -- whole-step graphs ---------------------------------------------------------------------
    def fused_decode(self, sb, run, sample, key, seed: int, steps_left: int,
                     vocab_ids: torch.Tensor, check_every: int = 8) -> int:
        """Decode ``sb`` (every prompt in a slot) until its rows finish; returns the steps run.

        ``run`` is the model call; ``sample(logits, sample_ids, steps, seed, vocab_ids)`` picks
        the tokens and returns them with their log-probs, without host syncs (``vocab_ids``: this rank's vocabulary ids, kept here);
        ``key`` names the sampling setting a captured graph bakes in (the seed is read from a
        buffer); ``steps_left`` bounds the steps (max_new_tokens minus the fewest tokens a live
        row has)."""
        fd = self.fused.get(key)
        if fd is None:
            fd = self.fused[key] = FusedDecode(self, sb.slots, sb.max_new, sb.stop_ids, vocab_ids)
        fd.model_call, fd.sample = run, sample
        return fd.run(sb, seed, steps_left, check_every)


class FusedDecode:
    """One captured whole decode step (model call, sampling, state update) over every slot."""

    STATE = ("lens", "count", "last", "active")

    def __init__(self, graphs: DecodeGraphs, slots: int, max_new: int, stop_ids, vocab_ids):
        dev = graphs.device
        self.graphs, self.slots, self.max_new = graphs, slots, max_new
        z = dict(dtype=torch.long, device=dev)
        self.lens, self.count, self.last = (torch.zeros(slots, **z) for _ in range(3))
        self.active = torch.zeros(slots, dtype=torch.bool, device=dev)
        self.sample_ids = torch.zeros(slots, **z)
        self.seed = torch.zeros(1, **z)
        self.stop_ids, self.vocab_ids = stop_ids.clone(), vocab_ids.clone()
        self.tokens = torch.zeros(slots, max_new + 1, **z)  # [slot, step]; column max_new: scratch
        self.logprobs = torch.zeros(slots, max_new + 1, dtype=torch.float32, device=dev)  # likewise
        self.rows = torch.arange(slots, device=dev)
        self.model_call = self.sample = None  # the running generation's (set per call)
        self.graph = None

    def step(self):
        """One decode step of every slot, in place on the static buffers."""
        n, width = self.slots, self.graphs.width
        self.graphs._cache.decode(n, self.lens, width)
        logits = self.model_call(self.last.unsqueeze(1), self.lens.unsqueeze(1), None, None)
        tok, logprob = self.sample(logits, self.sample_ids, self.count, self.seed, self.vocab_ids)
        act = self.active
        self.tokens[self.rows, self.count] = tok  # a finished row writes past its response
        self.logprobs[self.rows, self.count] = logprob
        inc = act.long()
        self.count.add_(inc)
        self.lens.add_(inc)
        self.last.copy_(torch.where(act, tok, self.last))
        done = (self.count >= self.max_new) | torch.isin(tok, self.stop_ids)
        self.active.logical_and_(~done)

    def run(self, sb, seed: int, steps_left: int, check_every: int) -> int:
        for name in self.STATE:
            getattr(self, name).copy_(getattr(sb, name))
        self.sample_ids.copy_(sb.results.sample_ids[sb.row])
        self.seed.fill_(seed)
        start, was_active = sb.count.clone(), sb.active.clone()
        capture = self.graphs.capture
        if capture and self.graph is None:
            saved = [getattr(self, name).clone() for name in self.STATE]

            def restore():
                for name, t in zip(self.STATE, saved):
                    getattr(self, name).copy_(t)

            self.graph, _ = self.graphs._capture(self.step, restore)
        steps = 0
        while steps < steps_left:
            for _ in range(min(check_every, steps_left - steps)):
                if capture:
                    self.graph.replay()
                else:
                    with self.graphs.guard():
                        self.step()
                steps += 1
            if not bool(self.active.any()):
                break
        self._write_back(sb, start, was_active)
        return steps

    def _write_back(self, sb, start: torch.Tensor, was_active: torch.Tensor) -> None:
        """The tokens of this phase into the generation's results; the SlotBatch's state."""
        for name in self.STATE:
            getattr(sb, name).copy_(getattr(self, name))
        live = was_active.nonzero().squeeze(1)
        rows, first, end = sb.row[live], start[live], self.count[live]
        cols = torch.arange(self.max_new, device=live.device).unsqueeze(0)
        take = (cols >= first.unsqueeze(1)) & (cols < end.unsqueeze(1))
        out = sb.results.out
        out[rows] = torch.where(take, self.tokens[live, :self.max_new], out[rows])
        lps = sb.results.logprobs
        lps[rows] = torch.where(take, self.logprobs[live, :self.max_new], lps[rows])
        sb.results.resp_len[rows] = end
        sb.sync_host()
        sb.free = sorted(set(range(sb.slots)) - set(sb.host_active))
        sb.done = not sb.queue and not sb.host_active
