"""Execute a routing table: local copies + bucketed point-to-point transfers (PUZZLE §5.2).

Every rank builds the same :class:`~puzzle.switch.routing.RoutingTable` (pure, deterministic)
and keeps the ops it takes part in:

* ``src_rank == dst_rank == me``: a local copy ``dst[dst_local][dst_box] = src[src_local][src_box]``;
* ``src_rank == me``: a send; ``dst_rank == me``: a receive.

Remote ops are grouped per (segment, peer) and packed, in table order, into flat buffers of at
most ``bucket_bytes`` (an op larger than a bucket gets its own). Sender and receiver derive the
same packing from the same table, so one bucket is one ``isend`` / ``irecv`` pair with a tag
unique to (segment, bucket). Receives for every segment are posted up front (non-blocking);
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
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from puzzle.switch.routing import RoutingTable, Transfer, box_to_slices

DEFAULT_BUCKET_BYTES = 32 * 1024 * 1024
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


@dataclass
class _Bucket:
    peer: int
    segment: int
    tag: int
    ops: List[Transfer]
    numel: int


def _numel(box) -> int:
    n = 1
    for a, b in box:
        n *= b - a
    return n


def _shape(box) -> Tuple[int, ...]:
    return tuple(b - a for a, b in box)


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
    """

    def __init__(self, table: RoutingTable, src_params: Mapping[str, torch.Tensor],
                 dst_params: Mapping[str, torch.Tensor], *, group=None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, num_segments: int = 1,
                 rank: Optional[int] = None):
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.table, self.group = table, group
        self.rank = dist.get_rank() if rank is None else rank
        self.src_params, self.dst_params = src_params, dst_params
        self.num_segments = num_segments
        self.segment_of = segment_of_params(table, num_segments)
        self.stats = SwitchStats(segments=num_segments)
        me = self.rank
        mine = table.ops_for_rank(me)
        self._check(mine)
        self.local: List[List[Transfer]] = [[] for _ in range(num_segments)]
        streams: Dict[Tuple[int, int, int], List[Transfer]] = defaultdict(list)  # (src, dst, seg)
        for op in mine:
            seg = self.segment_of[op.param]
            if op.is_local:
                self.local[seg].append(op)
            else:
                streams[(op.src_rank, op.dst_rank, seg)].append(op)
        self.send_buckets: List[List[_Bucket]] = [[] for _ in range(num_segments)]
        self.recv_buckets: List[_Bucket] = []
        for (s, d, seg), ops in sorted(streams.items()):
            esize = self._tensor(ops[0], send=(s == me)).element_size()
            for i, bucket_ops in enumerate(self._pack(ops, bucket_bytes, esize)):
                b = _Bucket(peer=d if s == me else s, segment=seg, tag=seg * _TAG_STRIDE + i,
                            ops=bucket_ops, numel=sum(_numel(o.src_box) for o in bucket_ops))
                (self.send_buckets[seg] if s == me else self.recv_buckets).append(b)
        self.stats.ops = len(mine)
        self._recv_work: List[Tuple[_Bucket, torch.Tensor, object]] = []
        self._send_work: List[Tuple[torch.Tensor, object]] = []
        self._t0: Optional[float] = None
        self._done = [False] * num_segments

    # ---- set-up ---------------------------------------------------------------------------
    def _tensor(self, op: Transfer, send: bool) -> torch.Tensor:
        return self.src_params[op.src_local] if send else self.dst_params[op.dst_local]

    def _check(self, ops: Sequence[Transfer]) -> None:
        """Every tensor this rank reads or writes exists and holds its box (before any transfer)."""
        me = self.rank
        for op in ops:
            for side, name, box, params in (("source", op.src_local, op.src_box, self.src_params),
                                            ("destination", op.dst_local, op.dst_box, self.dst_params)):
                if (side == "source" and op.src_rank != me) or (side == "destination" and op.dst_rank != me):
                    continue
                if name not in params:
                    raise KeyError(f"rank {me}: {side} parameter {name!r} (global {op.param}) is missing; "
                                   f"have {sorted(params)[:6]}...")
                shape = tuple(params[name].shape)
                if len(shape) != len(box) or any(b > s for (a, b), s in zip(box, shape)):
                    raise ValueError(f"rank {me}: {side} parameter {name!r} has shape {shape}, "
                                     f"too small for box {box} of {op.param}")

    @staticmethod
    def _pack(ops: List[Transfer], bucket_bytes: int, esize: int) -> List[List[Transfer]]:
        out, cur, cur_bytes = [], [], 0
        for op in ops:
            nb = _numel(op.src_box) * esize
            if cur and cur_bytes + nb > bucket_bytes:
                out.append(cur)
                cur, cur_bytes = [], 0
            cur.append(op)
            cur_bytes += nb
        if cur:
            out.append(cur)
        return out

    def _dtype(self, bucket: _Bucket, send: bool) -> torch.dtype:
        return self._tensor(bucket.ops[0], send).dtype

    def _device(self, bucket: _Bucket, send: bool) -> torch.device:
        return self._tensor(bucket.ops[0], send).device

    # ---- running -----------------------------------------------------------------------------
    def _start_clock(self):
        if self._t0 is None:
            self._t0 = time.perf_counter()

    def post_recvs(self) -> None:
        """Post every receive of every segment (non-blocking)."""
        self._start_clock()
        for b in self.recv_buckets:
            buf = torch.empty(b.numel, dtype=self._dtype(b, False), device=self._device(b, False))
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
        for op in self.local[seg]:
            src = self.src_params[op.src_local][box_to_slices(op.src_box)]
            self.dst_params[op.dst_local][box_to_slices(op.dst_box)].copy_(src)
            self.stats.bytes_local += src.numel() * src.element_size()
        for b in self.send_buckets[seg]:
            buf = torch.empty(b.numel, dtype=self._dtype(b, True), device=self._device(b, True))
            off = 0
            for op in b.ops:
                src = self.src_params[op.src_local][box_to_slices(op.src_box)]
                n = src.numel()
                buf[off:off + n].view(src.shape).copy_(src)
                off += n
            work = dist.isend(buf, dst=b.peer, group=self.group, tag=b.tag)
            self._send_work.append((buf, work))
            self.stats.messages_sent += 1
            self.stats.bytes_sent += buf.numel() * buf.element_size()

    @torch.no_grad()
    def finish(self) -> SwitchStats:
        """Run any segment not run yet, wait for every message, unpack the receives."""
        for seg in range(self.num_segments):
            if not self._done[seg]:
                self.run_segment(seg)
        t_wait = time.perf_counter()
        for b, buf, work in self._recv_work:
            work.wait()
            off = 0
            for op in b.ops:
                dst = self.dst_params[op.dst_local][box_to_slices(op.dst_box)]
                n = dst.numel()
                dst.copy_(buf[off:off + n].view(_shape(op.dst_box)))
                off += n
            self.stats.bytes_received += buf.numel() * buf.element_size()
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
