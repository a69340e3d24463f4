"""Device profiles for the plan search: hardware constants + per-layer time tables (pure Python).

A :class:`Profile` is what an offline profiler (PUZZLE §6 "Performance Profiling", ReaL §5.1)
fills in for one kind of machine:

* ``device_memory_bytes`` / ``memory_reserved_bytes`` (CUDA context, allocator slack),
* ``ranks_per_node`` and the effective bus bandwidths / latencies of collectives inside a node
  (NVLink) and across nodes (InfiniBand), in bytes/s and seconds,
* ``hbm_bandwidth`` (bytes/s, already the achievable rate),
* per model *shape* (hidden, ffn, heads, query groups, swiglu) a :class:`LayerTable`:
  time of ONE transformer layer on ONE GPU for forward and backward as a function of the
  tokens in a micro-batch, and of one decode step (context length 0) as a function of the
  number of sequences, each for every tensor-parallel degree T. Tables hold measured points;
  other sizes are interpolated linearly (and extrapolated proportionally), as in ReaL §5.1.
  Tensor-parallel communication is NOT part of the tables: the cost model adds it from the
  bandwidths, so a profiler must time the layer's kernels only.

Shapes missing from a profile fall back to :func:`analytic_layer_table`, the same first-
principles roofline that produced the bundled ``profiles/a100_80gb.json``.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Dict, List, Sequence, Tuple

from puzzle.model_shape import head_size_if_unusual, layer_params

PROFILE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")

#: hardware fields every profile JSON must carry (name -> (type, must be > 0)).
HARDWARE_FIELDS = {
    "device_memory_bytes": int,
    "memory_reserved_bytes": int,
    "ranks_per_node": int,
    "intra_node_bandwidth": float,
    "inter_node_bandwidth": float,
    "intra_node_latency_s": float,
    "inter_node_latency_s": float,
    "hbm_bandwidth": float,
    "peak_flops": float,
    "gemm_efficiency": float,
    "gemm_half_efficiency_flops": float,
    "layer_overhead_s": float,
    "decode_step_overhead_s": float,
}
#: optional hardware fields (name -> default): the fraction of a decode step's weight + KV-cache
#: read bound that a CUDA-graph-replayed step reaches (puzzle.bench.decode_step prints it as
#: ``graph_decode_efficiency``); 1.0, the bound itself, where a profile does not say.
#: host_link_bandwidth: bytes/s of pinned host <-> device copies per direction (PCIe 4.0 x16);
#: host_cores: the CPU cores the ``ranks_per_node`` ranks of a node share, where the ranks are
#: processes on a CPU host (0: every rank has a device of its own, as on GPUs), and
#: host_background_load: the host's other runnable processes while the profile was measured (its
#: 1-minute load average before the profiling world started). The tables are measured with every
#: rank busy beside that load; work on fewer busy ranks runs faster (:meth:`Profile.busy_ranks_factor`).
OPTIONAL_HARDWARE_FIELDS = {"graph_decode_efficiency": 1.0, "host_link_bandwidth": 25e9, "host_cores": 0.0,
                            "host_background_load": 0.0}
#: optional per-size tables ({size: seconds}, sizes powers of two):
#: ``allreduce_latency_s_by_ranks``: the latency of an all-reduce over a group of that many ranks
#: of one node, every group of the node busy at once (a CPU host with more ranks than cores waits
#: for its scheduler at every hop of a ring: a group of 4 measured ~4x a pair's latency on 2
#: cores); ``decode_step_overhead_s_by_tp``: the rest of a decode step at that tensor-parallel
#: degree (the collectives of the embedding and the vocab-parallel sampling grow with T). Where a
#: table lacks a size, the scalar field (``intra_node_latency_s``, ``decode_step_overhead_s``)
#: stands for it.
OPTIONAL_TABLE_FIELDS = ("allreduce_latency_s_by_ranks", "decode_step_overhead_s_by_tp")
SHAPE_FIELDS = ("hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "swiglu")


class ProfileError(ValueError):
    """A profile file or dictionary that is malformed."""


def shape_key(shape) -> tuple:
    """The per-layer identity of a model shape (anything with the ModelShape attributes); a head
    size other than hidden / heads (``kv_channels``, Qwen3) is appended."""
    key = (int(shape.hidden_size), int(shape.ffn_hidden_size), int(shape.num_attention_heads),
           int(shape.num_query_groups), bool(shape.swiglu))
    head = head_size_if_unusual(shape)
    return key if head is None else key + (head,)


def _interp(points: Sequence[Tuple[float, float]], x: float) -> float:
    """Piecewise-linear in x; below the first point: that point's value (launch-bound);
    above the last point: proportional to x (throughput-bound)."""
    xs = [p[0] for p in points]
    if x <= xs[0]:
        return points[0][1]
    if x >= xs[-1]:
        return points[-1][1] * x / xs[-1]
    i = bisect.bisect_right(xs, x)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass
class LayerTable:
    """Per-layer single-GPU times of one model shape. ``fwd_s[T]`` / ``bwd_s[T]``: sorted
    ``(tokens_per_micro_batch, seconds)``; ``decode_s[T]``: sorted ``(sequences, seconds)`` of
    one decode step at context length 0 (the KV-cache read is added by the cost model)."""

    name: str
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    swiglu: bool
    seq_len: int
    fwd_s: Dict[int, List[Tuple[float, float]]]
    bwd_s: Dict[int, List[Tuple[float, float]]]
    decode_s: Dict[int, List[Tuple[float, float]]]

    @property
    def key(self):
        return shape_key(self)

    def _table(self, which: str, T: int):
        tab = getattr(self, which)
        if T not in tab:
            raise ProfileError(f"layer table {self.name!r} has no {which} entry for T={T} (has {sorted(tab)})")
        return tab[T]

    def fwd(self, tokens: float, T: int) -> float:
        return _interp(self._table("fwd_s", T), tokens)

    def bwd(self, tokens: float, T: int) -> float:
        return _interp(self._table("bwd_s", T), tokens)

    def decode(self, sequences: float, T: int) -> float:
        return _interp(self._table("decode_s", T), sequences)

    def to_json(self) -> dict:
        def tab(t):
            return {str(T): [[x, y] for x, y in pts] for T, pts in sorted(t.items())}
        return {"name": self.name, "shape": {f: getattr(self, f) for f in SHAPE_FIELDS}, "seq_len": self.seq_len,
                "fwd_s": tab(self.fwd_s), "bwd_s": tab(self.bwd_s), "decode_s": tab(self.decode_s)}


@dataclass
class Profile:
    """Hardware constants + per-layer tables of one machine type (see module docstring)."""

    name: str
    device_memory_bytes: int
    memory_reserved_bytes: int
    ranks_per_node: int
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    intra_node_latency_s: float
    inter_node_latency_s: float
    hbm_bandwidth: float
    peak_flops: float
    gemm_efficiency: float
    gemm_half_efficiency_flops: float
    layer_overhead_s: float
    decode_step_overhead_s: float
    layers: Dict[tuple, LayerTable] = field(default_factory=dict)
    comment: str = ""
    graph_decode_efficiency: float = OPTIONAL_HARDWARE_FIELDS["graph_decode_efficiency"]
    host_link_bandwidth: float = OPTIONAL_HARDWARE_FIELDS["host_link_bandwidth"]
    host_cores: float = OPTIONAL_HARDWARE_FIELDS["host_cores"]
    host_background_load: float = OPTIONAL_HARDWARE_FIELDS["host_background_load"]
    allreduce_latency_s_by_ranks: Dict[int, float] = field(default_factory=dict)
    decode_step_overhead_s_by_tp: Dict[int, float] = field(default_factory=dict)

    # ---- primitives the cost model uses ------------------------------------------------
    def bandwidth(self, inter_node: bool) -> float:
        return self.inter_node_bandwidth if inter_node else self.intra_node_bandwidth

    def latency(self, inter_node: bool) -> float:
        return self.inter_node_latency_s if inter_node else self.intra_node_latency_s

    def gemm_eff(self, flops_per_gpu: float) -> float:
        """Achieved fraction of peak for a GEMM-dominated kernel sequence of that size."""
        return self.gemm_efficiency * flops_per_gpu / (flops_per_gpu + self.gemm_half_efficiency_flops)

    def gemm_time(self, flops_per_gpu: float) -> float:
        if flops_per_gpu <= 0:
            return 0.0
        return flops_per_gpu / (self.peak_flops * self.gemm_eff(flops_per_gpu))

    def hbm_time(self, nbytes: float) -> float:
        return nbytes / self.hbm_bandwidth

    def allreduce_latency(self, n: int, inter_node: bool) -> float:
        """Latency of an all-reduce over n ranks: ``allreduce_latency_s_by_ranks[n]`` inside a node
        where measured (beyond the largest measured size m: its latency x (n-1)/(m-1), the hops of
        a ring), else the scalar latency."""
        table = self.allreduce_latency_s_by_ranks
        if inter_node or not table:
            return self.latency(inter_node)
        if n in table:
            return table[n]
        m = max(table)
        return table[m] * (n - 1) / (m - 1) if n > m and m > 1 else self.latency(inter_node)

    def allreduce_time(self, nbytes: float, n: int, inter_node: bool) -> float:
        """Ring all-reduce of ``nbytes`` over n ranks: 2(n-1)/n * bytes / bus bandwidth + latency
        (:meth:`allreduce_latency`)."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        return 2.0 * (n - 1) / n * nbytes / self.bandwidth(inter_node) + self.allreduce_latency(n, inter_node)

    def busy_ranks_factor(self, busy: int) -> float:
        """The time of work on ``busy`` ranks of a node while its other ranks idle, as a fraction of
        the profiled time (every rank busy): a CPU host's ``host_cores`` shared by the busy ranks
        and the background load b, each at most one core: min(1, cores / (ranks_per_node + b)) /
        min(1, cores / (busy + b)) (2 cores, 4 ranks: 0.5 for 2 busy ranks on an idle host, 0.85
        beside a load of 9); 1.0 where ranks do not share cores (``host_cores`` 0, GPUs)."""
        if self.host_cores <= 0 or busy <= 0:
            return 1.0
        busy, bg, cores = min(busy, self.ranks_per_node), self.host_background_load, self.host_cores
        return min(1.0, cores / (self.ranks_per_node + bg)) / min(1.0, cores / (busy + bg))

    def decode_step_overhead(self, T: int) -> float:
        """The host's share of one decode step at tensor-parallel degree T (per model call)."""
        return self.decode_step_overhead_s_by_tp.get(T, self.decode_step_overhead_s)

    def layer_table(self, shape) -> LayerTable:
        """The profiled table of this shape, else the analytic roofline from the constants."""
        key = shape_key(shape)
        tab = self.layers.get(key)
        if tab is None:
            tab = analytic_layer_table(shape, self, name=f"analytic{key}")
            self.layers[key] = tab
        return tab

    # ---- JSON ----------------------------------------------------------------------------
    def to_json(self) -> dict:
        hw = {k: getattr(self, k) for k in HARDWARE_FIELDS}
        hw.update({k: getattr(self, k) for k, d in OPTIONAL_HARDWARE_FIELDS.items() if getattr(self, k) != d})
        hw.update({k: {str(n): v for n, v in sorted(getattr(self, k).items())} for k in OPTIONAL_TABLE_FIELDS
                   if getattr(self, k)})
        return {"_comment": self.comment, "name": self.name, "hardware": hw,
                "layers": [t.to_json() for t in self.layers.values() if not t.name.startswith("analytic")]}


# ---- validation / loading -------------------------------------------------------------------
def _num(v, where: str, typ) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ProfileError(f"{where} must be a finite non-negative number, got {v!r}")
    if typ is int and int(v) != v:
        raise ProfileError(f"{where} must be an integer, got {v!r}")
    return typ(v)


def _power_of_two_key(key, where: str, what: str, label: str = "") -> int:
    """A table's key (a JSON string) as the power of two it names (``what``: what the key is)."""
    try:
        n = int(key)
    except (TypeError, ValueError):
        raise ProfileError(f"{where}: key {key!r} is not {what}") from None
    if n < 1 or n & (n - 1):
        raise ProfileError(f"{where}: {label}{n} is not a power of two")
    return n


def _points(raw, where: str) -> Dict[int, List[Tuple[float, float]]]:
    if not isinstance(raw, dict) or not raw:
        raise ProfileError(f"{where} must be a non-empty object {{T: [[x, seconds], ...]}}")
    out = {}
    for tk, pts in raw.items():
        T = _power_of_two_key(tk, where, "a tensor-parallel degree", "T=")
        if not isinstance(pts, list) or not pts:
            raise ProfileError(f"{where}[{tk}] must be a non-empty list of [x, seconds]")
        row = []
        for i, p in enumerate(pts):
            if not isinstance(p, (list, tuple)) or len(p) != 2:
                raise ProfileError(f"{where}[{tk}][{i}] must be [x, seconds], got {p!r}")
            x, y = _num(p[0], f"{where}[{tk}][{i}][0]", float), _num(p[1], f"{where}[{tk}][{i}][1]", float)
            if x <= 0 or y <= 0:
                raise ProfileError(f"{where}[{tk}][{i}] must be positive, got {p!r}")
            row.append((x, y))
        if any(b[0] <= a[0] for a, b in zip(row, row[1:])):
            raise ProfileError(f"{where}[{tk}] x values must be strictly increasing")
        out[T] = row
    return out


def _size_table(raw, where: str) -> Dict[int, float]:
    """{size: seconds} of a JSON object {"<power of two>": seconds}."""
    if not isinstance(raw, dict):
        raise ProfileError(f"{where} must be an object {{size: seconds}}")
    out = {}
    for k, v in raw.items():
        out[_power_of_two_key(k, where, "a number of ranks")] = _num(v, f"{where}[{k}]", float)
    return out


def validate_profile(data: dict) -> Profile:
    """Check a profile dictionary (the JSON format) and build the :class:`Profile`.
    Raises :class:`ProfileError` naming the offending field."""
    if not isinstance(data, dict):
        raise ProfileError("profile must be a JSON object")
    for k in ("name", "hardware", "layers"):
        if k not in data:
            raise ProfileError(f"profile is missing {k!r}")
    hw = data["hardware"]
    if not isinstance(hw, dict):
        raise ProfileError("profile 'hardware' must be an object")
    vals = {}
    for k, typ in HARDWARE_FIELDS.items():
        if k not in hw:
            raise ProfileError(f"profile hardware is missing {k!r}")
        vals[k] = _num(hw[k], f"hardware.{k}", typ)
        if vals[k] <= 0 and k not in ("memory_reserved_bytes", "layer_overhead_s", "decode_step_overhead_s",
                                       "intra_node_latency_s", "inter_node_latency_s"):
            raise ProfileError(f"hardware.{k} must be > 0, got {hw[k]!r}")
    unknown = set(hw) - set(HARDWARE_FIELDS) - set(OPTIONAL_HARDWARE_FIELDS) - set(OPTIONAL_TABLE_FIELDS)
    if unknown:
        raise ProfileError(f"profile hardware has unknown fields {sorted(unknown)}")
    for k, default in OPTIONAL_HARDWARE_FIELDS.items():
        vals[k] = _num(hw.get(k, default), f"hardware.{k}", float)
    for k in ("gemm_efficiency", "graph_decode_efficiency"):
        if not 0 < vals[k] <= 1:
            raise ProfileError(f"hardware.{k} must be in (0, 1], got {vals[k]}")
    for k in OPTIONAL_TABLE_FIELDS:
        vals[k] = _size_table(hw.get(k, {}), f"hardware.{k}")
    prof = Profile(name=str(data["name"]), comment=str(data.get("_comment", "")), **vals)
    if not isinstance(data["layers"], list):
        raise ProfileError("profile 'layers' must be a list")
    for i, ent in enumerate(data["layers"]):
        where = f"layers[{i}]"
        if not isinstance(ent, dict):
            raise ProfileError(f"{where} must be an object")
        for k in ("name", "shape", "seq_len", "fwd_s", "bwd_s", "decode_s"):
            if k not in ent:
                raise ProfileError(f"{where} is missing {k!r}")
        sh = ent["shape"]
        if not isinstance(sh, dict) or any(f not in sh for f in SHAPE_FIELDS):
            raise ProfileError(f"{where}.shape must give {list(SHAPE_FIELDS)}")
        dims = {f: _num(sh[f], f"{where}.shape.{f}", int) for f in SHAPE_FIELDS[:4]}
        tab = LayerTable(name=str(ent["name"]), swiglu=bool(sh["swiglu"]), **dims,
                         seq_len=_num(ent["seq_len"], f"{where}.seq_len", int),
                         fwd_s=_points(ent["fwd_s"], f"{where}.fwd_s"), bwd_s=_points(ent["bwd_s"], f"{where}.bwd_s"),
                         decode_s=_points(ent["decode_s"], f"{where}.decode_s"))
        if tab.key in prof.layers:
            raise ProfileError(f"{where} ({tab.name}) repeats the shape of {prof.layers[tab.key].name}")
        prof.layers[tab.key] = tab
    return prof


def load_profile(path_or_name: str = "a100_80gb") -> Profile:
    """Load a profile JSON by path, or by the name of a bundled profile (``a100_80gb``)."""
    path = path_or_name
    if not os.path.exists(path):
        path = os.path.join(PROFILE_DIR, f"{path_or_name}.json")
    if not os.path.exists(path):
        bundled = sorted(f[:-5] for f in os.listdir(PROFILE_DIR) if f.endswith(".json"))
        raise ProfileError(f"no profile file {path_or_name!r} (bundled: {bundled})")
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ProfileError(f"{path}: not valid JSON: {e}") from None
    return validate_profile(data)


def save_profile(profile: Profile, path: str) -> None:
    data = profile.to_json()
    validate_profile(json.loads(json.dumps(data)))
    text = json.dumps(data, indent=1)
    text = re.sub(r"\[\s*([-0-9.e+]+),\s*([-0-9.e+]+)\s*\]", r"[\1, \2]", text)
    text = re.sub(r"\[\s*((?:\[[^\[\]]*\],?\s*)+)\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text)
    with open(path, "w") as f:
        f.write(text + "\n")


# ---- first-principles tables ---------------------------------------------------------------
def analytic_layer_table(shape, hw, name: str = "", seq_len: int = 512, T_values=(1, 2, 4, 8),
                         tokens=tuple(2 ** i for i in range(7, 17)),
                         sequences=tuple(2 ** i for i in range(0, 10))) -> LayerTable:
    """Roofline per-layer times from ``hw`` (a Profile or anything with its constants).

    forward GEMMs: 2 * tokens * split_params / T flops at ``hw.gemm_eff`` (efficiency falls for
    small per-GPU GEMMs); causal attention: 2 * tokens * seq_len * hidden / T flops; backward:
    twice the forward flops; decode step (context 0): max(weight bytes / HBM, GEMM time);
    each plus ``layer_overhead_s`` (kernel launches; x2 for backward). Decode GEMMs are skinny
    (HBM-bound), so their compute bound uses the asymptotic efficiency, not the small-GEMM one."""
    split, repl = layer_params(shape)
    h = shape.hidden_size
    fwd, bwd, dec = {}, {}, {}
    for T in T_values:
        f_row, b_row, d_row = [], [], []
        for n in tokens:
            flops = 2.0 * n * split / T + 2.0 * n * seq_len * h / T
            t = hw.gemm_time(flops)
            f_row.append((float(n), float(f"{t + hw.layer_overhead_s:.4g}")))
            b_row.append((float(n), float(f"{hw.gemm_time(2 * flops) + 2 * hw.layer_overhead_s:.4g}")))
        for b in sequences:
            weights = 2.0 * (split / T + repl)
            t = max(weights / hw.hbm_bandwidth, 2.0 * b * split / T / (hw.peak_flops * hw.gemm_efficiency))
            d_row.append((float(b), float(f"{t + hw.layer_overhead_s:.4g}")))
        fwd[T], bwd[T], dec[T] = f_row, b_row, d_row
    return LayerTable(name=name or "analytic", hidden_size=h, ffn_hidden_size=shape.ffn_hidden_size,
                      num_attention_heads=shape.num_attention_heads, num_query_groups=shape.num_query_groups,
                      swiglu=bool(shape.swiglu), seq_len=seq_len, fwd_s=fwd, bwd_s=bwd, decode_s=dec)
