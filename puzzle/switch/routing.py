"""Routing tables for switching a model's parameters between two parallel plans (pure Python).

PUZZLE (ATC'24, §5.2, Algorithm 1) converts a rank's (p, d, t) index from the source base
(P, D, T) to the destination base for the case "P shrinks by f_P, T grows by f_T, D fixed".
This module generalises it: any source and destination plan on the same ranks (P up or down,
T up or down, D changing, uneven pipeline splits, tied embeddings), computed per parameter
from global index boxes:

* every destination rank r needs, for each parameter its dst stage holds, the global boxes
  ``shard_slices(spec, dst.T, t)``;
* each needed box is cut at the source shard boundaries; each piece comes from a source rank
  holding it: r itself when it holds the piece already (a local copy, no traffic), else the
  holder that is on r's node (when ``ranks_per_node`` is given), then has sent the fewest bytes
  so far, ties broken by rank distance from r (deterministic greedy sender balancing);
* adjacent pieces from one source are merged, so one parameter from one source to one
  destination is one op (two for SwiGLU fc1, whose local shard is [gate_t; up_t]);
* experts' parameters (mixture of experts) are held by the ranks of one expert-parallel rank
  of their stage (E splits a layer's experts in contiguous blocks, local expert indices from 0)
  and split over the expert-tensor-parallel ranks (ETP) instead of T; switching between plans of
  different E moves each expert to the ranks that lack it, like any other parameter.

Every rank computes the same table (no communication, stable order) and keeps its own ops.
Executing a table: each op copies ``src[src_local][src_box]`` (the SOURCE-layout shard on
src_rank) into ``dst[dst_local][dst_box]`` (the DESTINATION-layout shard on dst_rank); local
copies have src_rank == dst_rank. A rank must keep its source shards until its sends are done.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Sequence, Tuple

from puzzle.parallel.plan import ParallelPlan, PlanError
from puzzle.models.param_layout import (Box, ParamSpec, check_tp_split, expert_holding, expert_local_name,
                                        num_layers_of, params_on_stage, resolve_layers_per_stage, shard_slices)


@dataclass(frozen=True)
class Transfer:
    """Copy one box of parameter ``param`` (global name) from src_rank to dst_rank.

    ``src_box`` indexes the source rank's local shard (source layout, local name
    ``src_local``), ``dst_box`` the destination rank's local shard (destination layout, local
    name ``dst_local``), ``global_box`` the full tensor. Boxes: one (start, stop) per dim."""

    param: str
    src_rank: int
    dst_rank: int
    src_box: Box
    dst_box: Box
    global_box: Box
    nbytes: int
    src_local: str = ""
    dst_local: str = ""

    @property
    def is_local(self) -> bool:
        return self.src_rank == self.dst_rank


@dataclass(frozen=True)
class _Holder:
    """A rank holding (part of) one parameter in one layout."""
    rank: int
    local_name: str
    pieces: Tuple[Box, ...]          # global boxes, concatenated along the split dim
    offsets: Tuple[int, ...]         # local start of each piece along the split dim


def box_to_slices(box: Box) -> Tuple[slice, ...]:
    """(start, stop) ranges -> a tuple of slices for indexing a tensor/array."""
    return tuple(slice(a, b) for a, b in box)


def _axis(spec: ParamSpec) -> int:
    return spec.split_dim if spec.split_dim is not None else 0


def _unit_bytes(spec: ParamSpec, dtype_bytes: int) -> int:
    """Bytes of one index step along the split axis (the product of the other dims)."""
    k = _axis(spec)
    n = dtype_bytes
    for i, s in enumerate(spec.global_shape):
        if i != k:
            n *= s
    return n


def _holder(spec: ParamSpec, rank: int, local: str, ways: int, index: int) -> _Holder:
    """What ``rank`` holds of ``spec``: split ``ways`` ways (T, or ETP for experts), part ``index``."""
    k = _axis(spec)
    pieces = tuple(shard_slices(spec, ways, index))
    offsets, off = [], 0
    for b in pieces:
        offsets.append(off)
        off += b[k][1] - b[k][0]
    return _Holder(rank, local, pieces, tuple(offsets))


def _placement(specs: Sequence[ParamSpec], plan: ParallelPlan, lps: List[int]) -> Dict[str, Dict[int, _Holder]]:
    """spec name -> {rank: holder} for every rank of ``plan`` holding that parameter.

    Dense parameters: every (d, t) rank of their stage holds TP part t. Experts' parameters:
    the ranks of expert-parallel rank ep (experts ``[ep * n, (ep + 1) * n)``, n = num_experts / E)
    hold them, expert-TP part etp, under the local expert index megatron gives them."""
    out: Dict[str, Dict[int, _Holder]] = {s.name: {} for s in specs}
    for p in range(plan.P):
        for local, spec in params_on_stage(specs, p, plan.P, lps):
            if spec.expert is not None:
                ep, index = expert_holding(spec, plan.E)
                local = expert_local_name(local, index)
                for etp in range(plan.ETP):
                    for edp in range(plan.EDP):
                        r = plan.expert_rank(p, edp, ep, etp)
                        out[spec.name][r] = _holder(spec, r, local, plan.ETP, etp)
                continue
            for t in range(plan.T):
                for d in range(plan.D):
                    r = plan.rank(p, d, t)
                    out[spec.name][r] = _holder(spec, r, local, plan.T, t)
    return out


def local_params(specs: Sequence[ParamSpec], plan: ParallelPlan, rank: int,
                 layers_per_stage: Optional[Sequence[int]] = None) -> List[Tuple[str, ParamSpec]]:
    """(local name, spec) of every parameter ``rank`` holds in ``plan``, in spec order: its
    stage's parameters (:func:`params_on_stage`), of the experts only those of its expert-parallel
    rank, named by their local expert index."""
    p, _, ep, _ = plan.expert_coords(rank)
    out = []
    for local, spec in params_on_stage(specs, p, plan.P, layers_per_stage):
        if spec.expert is not None:
            holder_ep, index = expert_holding(spec, plan.E)
            if holder_ep != ep:
                continue
            local = expert_local_name(local, index)
        out.append((local, spec))
    return out


def _with_axis(box: Box, k: int, lo: int, hi: int) -> Box:
    b = list(box)
    b[k] = (lo, hi)
    return tuple(b)


def _local_box(spec: ParamSpec, k: int, lo: int, hi: int) -> Box:
    return tuple((lo, hi) if i == k else (0, s) for i, s in enumerate(spec.global_shape))


def _covered(holder: Optional[_Holder], k: int, a: int, b: int) -> int:
    """Length of [a, b) along the split axis that ``holder`` holds."""
    if holder is None:
        return 0
    return sum(max(0, min(b, p[k][1]) - max(a, p[k][0])) for p in holder.pieces)


class RoutingTable:
    """The transfers that turn the source layout into the destination layout.

    ``ops`` is in a stable order (parameter spec order, then destination rank, then position),
    identical on every rank. Byte counts exclude local copies unless stated."""

    def __init__(self, ops: List[Transfer], specs: Sequence[ParamSpec], src: ParallelPlan, dst: ParallelPlan,
                 src_place, dst_place, dtype_bytes: int):
        self.ops = ops
        self.specs = list(specs)
        self.src, self.dst = src, dst
        self.dtype_bytes = dtype_bytes
        self._src_place, self._dst_place = src_place, dst_place

    def with_destination_moved(self, delta: int, dst: ParallelPlan) -> "RoutingTable":
        """This table with every destination rank moved by ``delta`` to ``dst`` (the same layout
        on other ranks: a generation pool beside the training ranks). A destination rank that was
        a source rank now is not, so each transfer that was a local copy crosses ranks."""
        if (dst.P, dst.D, dst.T, dst.E) != (self.dst.P, self.dst.D, self.dst.T, self.dst.E):
            raise ValueError(f"with_destination_moved: {dst} is not the layout of {self.dst}")
        ops = [replace(o, dst_rank=o.dst_rank + delta) for o in self.ops]
        dst_place = {name: {r + delta: replace(h, rank=r + delta) for r, h in holders.items()}
                     for name, holders in self._dst_place.items()}
        return RoutingTable(ops, self.specs, self.src, dst, self._src_place, dst_place, self.dtype_bytes)

    # ---- per-rank views ------------------------------------------------------------------
    def ops_for_rank(self, rank: int) -> List[Transfer]:
        """Ops this rank takes part in (sends, receives and local copies), in table order."""
        return [o for o in self.ops if o.src_rank == rank or o.dst_rank == rank]

    def sends(self, rank: int) -> List[Transfer]:
        return [o for o in self.ops if o.src_rank == rank and not o.is_local]

    def recvs(self, rank: int) -> List[Transfer]:
        return [o for o in self.ops if o.dst_rank == rank and not o.is_local]

    # ---- volumes -------------------------------------------------------------------------
    def bytes_received(self, rank: int) -> int:
        return sum(o.nbytes for o in self.recvs(rank))

    def bytes_sent(self, rank: int) -> int:
        return sum(o.nbytes for o in self.sends(rank))

    def total_bytes(self) -> int:
        """Bytes crossing between ranks (local copies excluded)."""
        return sum(o.nbytes for o in self.ops if not o.is_local)

    def bytes_lacking(self, rank: int) -> int:
        """Bytes of the rank's destination-layout shards that it does not hold in the source
        layout: the least any routing must deliver to it (computed independently of ops)."""
        total = 0
        for spec in self.specs:
            need = self._dst_place[spec.name].get(rank)
            if need is None:
                continue
            own = self._src_place[spec.name].get(rank)
            k, ub = _axis(spec), _unit_bytes(spec, self.dtype_bytes)
            for piece in need.pieces:
                a, b = piece[k]
                total += (b - a - _covered(own, k, a, b)) * ub
        return total

    def model_bytes(self) -> int:
        """Bytes of the full model (each distinct parameter once, tied embeddings once)."""
        return sum(s.numel for s in self.specs) * self.dtype_bytes

    def allgather_bytes(self, rank: int) -> int:
        """Baseline: a DeepSpeed-Chat-style switch where every rank all-gathers the FULL,
        unsharded model (every distinct parameter) and then keeps what it needs. The rank
        receives every byte of the full model it does not already hold in the source layout:
        ``model_bytes() - held_src(rank)`` (about (N-1)/N of the model for a fully sharded
        N-rank source)."""
        held = 0
        for spec in self.specs:
            own = self._src_place[spec.name].get(rank)
            if own is not None:
                k = _axis(spec)
                held += _covered(own, k, 0, spec.global_shape[k]) * _unit_bytes(spec, self.dtype_bytes)
        return self.model_bytes() - held


# ---- construction --------------------------------------------------------------------------------
def _check_plans(specs: Sequence[ParamSpec], src: ParallelPlan, dst: ParallelPlan) -> None:
    for what, plan in (("source", src), ("destination", dst)):
        if not isinstance(plan, ParallelPlan):
            raise PlanError(f"{what} plan must be a ParallelPlan, got {type(plan).__name__}")
    if src.size != dst.size:
        raise PlanError(f"cannot switch between plans on different world sizes: source plan {src} uses "
                        f"{src.size} ranks, destination plan {dst} uses {dst.size} (P*D*T must match)")
    if src.offset != dst.offset:
        raise PlanError(f"cannot switch between plans on different ranks: source plan {src} starts at rank "
                        f"{src.offset}, destination plan {dst} at rank {dst.offset}")
    problems: Dict[str, str] = {}
    for what, plan in (("source plan", src), ("destination plan", dst)):
        for spec in specs:
            if spec.expert is not None and spec.num_experts % plan.E:
                problems.setdefault(f"{what}:num_experts", f"num_experts={spec.num_experts} is not divisible "
                                                           f"by E={plan.E} of {what} {plan}")
            err = check_tp_split(spec, plan.ETP if spec.expert is not None else plan.T, f"{what} {plan}")
            if err:
                problems.setdefault(f"{what}:{spec.split_label or spec.name}", err)
    if problems:
        raise PlanError("model cannot be split by the plans: " + "; ".join(problems.values()))


def _route_param(spec: ParamSpec, need: _Holder, holders: Dict[int, _Holder], sent: Dict[int, int],
                 node_of, world: int, dtype_bytes: int) -> List[Transfer]:
    """Ops delivering destination holder ``need`` of one parameter from the source holders."""
    if not holders:
        raise PlanError(f"no source rank holds parameter {spec.name}")
    k, ub = _axis(spec), _unit_bytes(spec, dtype_bytes)
    frags: List[list] = []  # [src_rank, src_lo, dst_lo, glo, ghi, dst_piece_index]
    for pi, (piece, doff) in enumerate(zip(need.pieces, need.offsets)):
        a, b = piece[k]
        cuts = {a, b}
        for h in holders.values():
            for sp in h.pieces:
                cuts.update(x for x in sp[k] if a < x < b)
        cuts = sorted(cuts)
        for x, y in zip(cuts, cuts[1:]):
            cands = []
            for h in holders.values():
                for sp, soff in zip(h.pieces, h.offsets):
                    if sp[k][0] <= x and y <= sp[k][1]:
                        cands.append((h.rank, soff + x - sp[k][0]))
            if not cands:
                raise PlanError(f"no source rank holds {spec.name}[{x}:{y}] along dim {k}")
            local = [c for c in cands if c[0] == need.rank]
            if local:
                rank, src_lo = local[0]
            else:
                def key(c):
                    off_node = node_of is not None and node_of(c[0]) != node_of(need.rank)
                    return (off_node, sent[c[0]], (c[0] - need.rank) % world, c[0])
                rank, src_lo = min(cands, key=key)
                sent[rank] += (y - x) * ub
            prev = frags[-1] if frags else None
            if (prev and prev[0] == rank and prev[5] == pi and prev[4] == x
                    and prev[1] + (prev[4] - prev[3]) == src_lo):
                prev[4] = y  # contiguous in global, source-local and destination-local index
            else:
                frags.append([rank, src_lo, doff + x - a, x, y, pi])
    ops = []
    for rank, src_lo, dst_lo, x, y, pi in frags:
        n = y - x
        ops.append(Transfer(param=spec.name, src_rank=rank, dst_rank=need.rank,
                            src_box=_local_box(spec, k, src_lo, src_lo + n),
                            dst_box=_local_box(spec, k, dst_lo, dst_lo + n),
                            global_box=_with_axis(need.pieces[pi], k, x, y), nbytes=n * ub,
                            src_local=holders[rank].local_name, dst_local=need.local_name))
    return ops


def build_routing_table(specs: Sequence[ParamSpec], src: ParallelPlan, dst: ParallelPlan, *,
                        layers_per_stage_src: Optional[Sequence[int]] = None,
                        layers_per_stage_dst: Optional[Sequence[int]] = None,
                        ranks_per_node: Optional[int] = None, dtype_bytes: int = 4) -> RoutingTable:
    """Routing table from the ``src`` layout to the ``dst`` layout of the model ``specs``.

    Both plans must cover the same ranks; the model must split at both (layers by P, heads /
    query groups / ffn / vocab by T), else PlanError. ``layers_per_stage_*``: explicit uneven
    pipeline splits. ``ranks_per_node``: prefer same-node senders (node = rank // ranks_per_node).
    """
    specs = list(specs)
    if len({s.name for s in specs}) != len(specs):
        raise ValueError("parameter specs have duplicate names")
    _check_plans(specs, src, dst)
    if ranks_per_node is not None and ranks_per_node < 1:
        raise PlanError(f"ranks_per_node must be positive, got {ranks_per_node}")
    n_layers = num_layers_of(specs)
    lps_src = resolve_layers_per_stage(n_layers, src.P, layers_per_stage_src, f"source plan {src}")
    lps_dst = resolve_layers_per_stage(n_layers, dst.P, layers_per_stage_dst, f"destination plan {dst}")
    src_place = _placement(specs, src, lps_src)
    dst_place = _placement(specs, dst, lps_dst)
    node_of = (lambda r: r // ranks_per_node) if ranks_per_node else None
    sent: Dict[int, int] = defaultdict(int)
    ops: List[Transfer] = []
    for spec in specs:
        for r in sorted(dst_place[spec.name]):
            ops.extend(_route_param(spec, dst_place[spec.name][r], src_place[spec.name], sent, node_of,
                                    src.size, dtype_bytes))
    return RoutingTable(ops, specs, src, dst, src_place, dst_place, dtype_bytes)
