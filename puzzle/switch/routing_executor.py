"""Execute a routing table: local copies + bucketed point-to-point transfers (PUZZLE §5.2).

Every rank builds the same :class:`~puzzle.switch.routing.RoutingTable` (pure, deterministic)
and keeps the ops it takes part in:

* ``src_rank == dst_rank == me``: a local copy ``dst[dst_local][dst_box] = src[src_local][src_box]``;
* ``src_rank == me``: a send; ``dst_rank == me``: a receive.

Remote ops are grouped per (segment, peer) and packed, in table order, into flat buffers of at
most ``bucket_bytes`` (an op larger than a bucket gets its own); an op of at least
``DIRECT_MIN_BYTES`` whose boxes are contiguous (a range of the first split dim) is a message of
its own, sent from the source tensor and received into the destination tensor (no copies).
Sender and receiver derive the same messages from the same table, so one message is one
``isend`` / ``irecv`` pair with a tag unique to (segment, message). A rank's plan (its ops,
messages and indices) is derived once per table and cached; the copies and messages run
without the CPU backend's device-mapping mode (a Python call per torch call). A direct send reads its
source tensor until :meth:`RoutingExecutor.finish`: nothing may change a sent range before then
(in :mod:`puzzle.switch.overlap` later segments update other parameters; the
DistributedOptimizer's bucket all-gather rewrites sent ranges with the values they already hold). Receives for every segment are posted up front (non-blocking);
sends of segment k are posted by :meth:`RoutingExecutor.run_segment` once the caller says the
source shards of segment k are final (:mod:`puzzle.switch.overlap` calls it right after the
optimizer has updated segment k). Per peer pair, sends and receives are posted in the same
(segment, bucket) order, so the exchange cannot deadlock on gloo (tag matching) nor on NCCL
(in-order matching per pair).

Segments are contiguous ranges of the table's PARAMETERS (spec order), balanced by bytes, so
every rank derives the same parameter -> segment map (:func:`segment_of_params`).
"""

from __future__ import annotations

import time
import weakref
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

from puzzle.switch.routing import RoutingTable, Transfer, box_to_slices

DEFAULT_BUCKET_BYTES = 32 * 1024 * 1024
#: a contiguous op at least this large is its own message (no packing copies)
DIRECT_MIN_BYTES = 256 * 1024
_TAG_STRIDE = 1 << 16  # tags: segment * _TAG_STRIDE + bucket index of the (src, dst, segment) stream


@dataclass
class SwitchStats:
    """What one rank did during a switch (bytes exclude local copies unless named so)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_local: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    ops: int = 0
    segments: int = 1
    time_s: float = 0.0
    wait_s: float = 0.0  # time spent blocked in finish() waiting for outstanding messages
    extra: Dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "extra"}
        d.update(self.extra)
        return d


def segment_of_params(table: RoutingTable, num_segments: int) -> Dict[str, int]:
    """Global parameter name -> segment in [0, num_segments): contiguous runs of the table's
    parameters in spec (= routing-op) order, balanced by parameter bytes. Pure; identical on
    every rank."""
    if num_segments < 1:
        raise ValueError(f"num_segments must be >= 1, got {num_segments}")
    total = sum(s.numel for s in table.specs) or 1
    out, before = {}, 0
    for s in table.specs:
        out[s.name] = min(num_segments - 1, (before * num_segments) // total)
        before += s.numel
    return out


Index = Tuple[slice, ...]


@dataclass(frozen=True)
class _Piece:
    """One op's part of a message or local copy: ``tensor[index]`` of the rank's local tensor
    ``name`` (``numel`` elements of ``shape``)."""

    name: str
    index: Index
    numel: int
    shape: Tuple[int, ...]


@dataclass(frozen=True)
class _Bucket:
    """One message: pieces packed in table order into ``numel`` elements."""

    peer: int
    segment: int
    tag: int
    pieces: Tuple[_Piece, ...]
    numel: int
    direct: bool = False  # one contiguous piece, sent from / received into the tensor itself


def _numel(box) -> int:
    n = 1
    for a, b in box:
        n *= b - a
    return n


def _shape(box) -> Tuple[int, ...]:
    return tuple(b - a for a, b in box)


def _piece(name: str, box) -> _Piece:
    return _Piece(name, box_to_slices(box), _numel(box), _shape(box))


def _contiguous(op: Transfer, axis: int) -> bool:
    """Whether ``op``'s boxes are contiguous in both local tensors. A box spans every dim of the
    local tensor but the split axis (whose range it may cut), on both sides: it is contiguous
    when every dim before that axis has extent 1. Pure (sender and receiver agree)."""
    return all(b - a == 1 for a, b in op.src_box[:axis])


def _pack(ops: List[Transfer], bucket_bytes: int, esize: int, axis_of: Mapping[str, int]
          ) -> List[Tuple[bool, List[Transfer]]]:
    """(direct, ops) messages of one (src, dst, segment) stream, in table order: a contiguous op
    of at least DIRECT_MIN_BYTES is a message of its own (no copy on either side), the others are
    packed into buckets of at most ``bucket_bytes``."""
    out, cur, cur_bytes = [], [], 0
    for op in ops:
        nb = _numel(op.src_box) * esize
        if nb >= DIRECT_MIN_BYTES and _contiguous(op, axis_of[op.param]):
            out.append((True, [op]))
            continue
        if cur and cur_bytes + nb > bucket_bytes:
            out.append((False, cur))
            cur, cur_bytes = [], 0
        cur.append(op)
        cur_bytes += nb
    if cur:
        out.append((False, cur))
    return out


class _RankPlan:
    """What one rank does for one (table, segments, bucket size, element size): its local copies
    and messages per segment, with every index precomputed. Pure; built once and cached on the
    table (:func:`_rank_plan`), so a switch spends no time re-deriving it."""

    def __init__(self, table: RoutingTable, rank: int, num_segments: int, bucket_bytes: int, esize: int):
        self.segment_of = segment_of_params(table, num_segments)
        mine = table.ops_for_rank(rank)
        self.num_ops = len(mine)
        #: (side, local name) -> (global name, smallest shape holding every box of that side)
        self.extents: Dict[Tuple[str, str], Tuple[str, List[int]]] = {}
        self.local: List[List[Tuple[_Piece, _Piece]]] = [[] for _ in range(num_segments)]
        streams: Dict[Tuple[int, int, int], List[Transfer]] = defaultdict(list)  # (src, dst, seg)
        for op in mine:
            if op.src_rank == rank:
                self._extend("source", op.src_local, op.src_box, op.param)
            if op.dst_rank == rank:
                self._extend("destination", op.dst_local, op.dst_box, op.param)
            seg = self.segment_of[op.param]
            if op.is_local:
                self.local[seg].append((_piece(op.src_local, op.src_box), _piece(op.dst_local, op.dst_box)))
            else:
                streams[(op.src_rank, op.dst_rank, seg)].append(op)
        self.send_buckets: List[List[_Bucket]] = [[] for _ in range(num_segments)]
        self.recv_buckets: List[_Bucket] = []
        axis_of = {spec.name: spec.split_dim or 0 for spec in table.specs}
        for (s, d, seg), ops in sorted(streams.items()):
            send = s == rank
            for i, (direct, bucket_ops) in enumerate(_pack(ops, bucket_bytes, esize, axis_of)):
                pieces = tuple(_piece(o.src_local, o.src_box) if send else _piece(o.dst_local, o.dst_box)
                               for o in bucket_ops)
                b = _Bucket(peer=d if send else s, segment=seg, tag=seg * _TAG_STRIDE + i, pieces=pieces,
                            numel=sum(p.numel for p in pieces), direct=direct)
                (self.send_buckets[seg] if send else self.recv_buckets).append(b)

    def _extend(self, side: str, name: str, box, param: str) -> None:
        _, stops = self.extents.setdefault((side, name), (param, [0] * len(box)))
        if len(stops) != len(box):
            raise ValueError(f"{side} parameter {name!r}: boxes of different ranks ({param})")
        for i, (_, b) in enumerate(box):
            stops[i] = max(stops[i], b)


_PLANS: "weakref.WeakKeyDictionary[RoutingTable, Dict[tuple, _RankPlan]]" = weakref.WeakKeyDictionary()


def _rank_plan(table: RoutingTable, rank: int, num_segments: int, bucket_bytes: int, esize: int) -> _RankPlan:
    """The cached :class:`_RankPlan` (the table lives as long as its cache entry)."""
    plans = _PLANS.setdefault(table, {})
    key = (rank, num_segments, bucket_bytes, esize)
    if key not in plans:
        plans[key] = _RankPlan(table, rank, num_segments, bucket_bytes, esize)
    return plans[key]


def _element_size(table: RoutingTable, *param_maps: Mapping[str, torch.Tensor]) -> int:
    for params in param_maps:
        for t in params.values():
            return t.element_size()
    return table.dtype_bytes


def fast_dispatch():
    """Torch calls without the CPU backend's device-mapping mode (one Python call per torch call,
    even per ``Parameter.data``): for the switch's own work, which creates tensors only on its
    parameters' own device. A no-op off the CPU backend (``device_mapping_suspended`` says so)."""
    from megatron_patches import cpu_backend

    return cpu_backend.device_mapping_suspended()


class RoutingExecutor:
    """One rank's part of a routing table, runnable in segments.

    ``src_params``: local name -> this rank's SOURCE-layout shard (read); ``dst_params``: local
    name -> this rank's DESTINATION-layout shard (written). Names are the table's local names
    (``Transfer.src_local`` / ``dst_local``). Usage::

        ex = RoutingExecutor(table, src, dst, num_segments=K)
        ex.post_recvs()
        for k in range(K):
            ...                 # make segment k of src final
            ex.run_segment(k)   # local copies + isends of segment k
        stats = ex.finish()     # wait, unpack receives

    The rank's plan (its ops, buckets and indices) is derived once per table and reused by
    every later executor of the same table, rank, segments and bucket size.
    """

    def __init__(self, table: RoutingTable, src_params: Mapping[str, torch.Tensor],
                 dst_params: Mapping[str, torch.Tensor], *, group=None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, num_segments: int = 1,
                 rank: Optional[int] = None):
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        if num_segments < 1:
            raise ValueError(f"num_segments must be >= 1, got {num_segments}")
        self.table, self.group = table, group
        self.rank = dist.get_rank() if rank is None else rank
        self.src_params, self.dst_params = src_params, dst_params
        self.num_segments = num_segments
        self.plan = _rank_plan(table, self.rank, num_segments, bucket_bytes,
                               _element_size(table, src_params, dst_params))
        self.segment_of = self.plan.segment_of
        self._check()
        self.stats = SwitchStats(segments=num_segments, ops=self.plan.num_ops)
        self._recv_work: List[Tuple[_Bucket, torch.Tensor, object]] = []
        self._send_work: List[Tuple[torch.Tensor, object]] = []
        self._t0: Optional[float] = None
        self._done = [False] * num_segments

    # ---- set-up ---------------------------------------------------------------------------
    def _check(self) -> None:
        """Every tensor this rank reads or writes exists and holds its boxes (before any transfer)."""
        me = self.rank
        for (side, name), (param, stops) in self.plan.extents.items():
            params = self.src_params if side == "source" else self.dst_params
            if name not in params:
                raise KeyError(f"rank {me}: {side} parameter {name!r} (global {param}) is missing; "
                               f"have {sorted(params)[:6]}...")
            shape = tuple(params[name].shape)
            if len(shape) != len(stops) or any(b > s for b, s in zip(stops, shape)):
                raise ValueError(f"rank {me}: {side} parameter {name!r} has shape {shape}, "
                                 f"too small for the boxes of {param} (they reach {tuple(stops)})")

    @staticmethod
    def _view(piece: _Piece, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
        view = params[piece.name][piece.index]
        if not view.is_contiguous():  # a tensor not laid out row-major: the plan assumed it is
            raise ValueError(f"{piece.name}{list(piece.shape)}: a direct message needs a contiguous tensor")
        return view

    def _buffer(self, bucket: _Bucket, params: Mapping[str, torch.Tensor]) -> torch.Tensor:
        like = params[bucket.pieces[0].name]
        return torch.empty(bucket.numel, dtype=like.dtype, device=like.device)

    # ---- running -----------------------------------------------------------------------------
    def _start_clock(self):
        if self._t0 is None:
            self._t0 = time.perf_counter()

    def post_recvs(self) -> None:
        """Post every receive of every segment (non-blocking)."""
        self._start_clock()
        with fast_dispatch():
            for b in self.plan.recv_buckets:
                buf = self._view(b.pieces[0], self.dst_params) if b.direct else self._buffer(b, self.dst_params)
                work = dist.irecv(buf, src=b.peer, group=self.group, tag=b.tag)
                self._recv_work.append((b, buf, work))
                self.stats.messages_received += 1

    @torch.no_grad()
    def run_segment(self, seg: int) -> None:
        """Local copies and sends of segment ``seg``: its source shards must be final now."""
        self._start_clock()
        if self._done[seg]:
            raise RuntimeError(f"segment {seg} already ran")
        self._done[seg] = True
        src_params, dst_params = self.src_params, self.dst_params
        with fast_dispatch():
            for s, d in self.plan.local[seg]:
                src = src_params[s.name][s.index]
                dst_params[d.name][d.index].copy_(src)
                self.stats.bytes_local += s.numel * src.element_size()
            for b in self.plan.send_buckets[seg]:
                if b.direct:
                    buf = self._view(b.pieces[0], src_params)
                else:
                    buf = self._buffer(b, src_params)
                    off = 0
                    for p in b.pieces:
                        buf[off:off + p.numel].view(p.shape).copy_(src_params[p.name][p.index])
                        off += p.numel
                work = dist.isend(buf, dst=b.peer, group=self.group, tag=b.tag)
                self._send_work.append((buf, work))
                self.stats.messages_sent += 1
                self.stats.bytes_sent += b.numel * buf.element_size()

    @torch.no_grad()
    def finish(self) -> SwitchStats:
        """Run any segment not run yet, wait for every message, unpack the receives."""
        for seg in range(self.num_segments):
            if not self._done[seg]:
                self.run_segment(seg)
        t_wait = time.perf_counter()
        dst_params = self.dst_params
        with fast_dispatch():
            for b, buf, work in self._recv_work:
                work.wait()
                off = 0
                for p in () if b.direct else b.pieces:
                    dst_params[p.name][p.index].copy_(buf[off:off + p.numel].view(p.shape))
                    off += p.numel
                self.stats.bytes_received += b.numel * buf.element_size()
            for _, work in self._send_work:
                work.wait()
        now = time.perf_counter()
        self.stats.wait_s = now - t_wait
        self.stats.time_s = now - (self._t0 if self._t0 is not None else t_wait)
        self._recv_work, self._send_work = [], []
        return self.stats


def execute_routing(table: RoutingTable, src_params: Mapping[str, torch.Tensor],
                    dst_params: Mapping[str, torch.Tensor], group=None,
                    bucket_bytes: int = DEFAULT_BUCKET_BYTES, num_segments: int = 1) -> SwitchStats:
    """Run this rank's part of ``table`` to completion (collective over the table's ranks).

    Returns this rank's :class:`SwitchStats` (bytes sent / received / copied locally, time)."""
    ex = RoutingExecutor(table, src_params, dst_params, group=group, bucket_bytes=bucket_bytes,
                         num_segments=num_segments)
    ex.post_recvs()
    for seg in range(num_segments):
        ex.run_segment(seg)
    return ex.finish()
