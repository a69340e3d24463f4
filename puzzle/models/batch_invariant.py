"""``--batch-invariant-mode`` (Megatron-LM's name): generation and scoring compute bitwise the same
log-probs of the sampled tokens.

A KV-cached decode step runs one token per row; scoring runs the same tokens in a packed (or
padded) full forward. Both use the same weights and the same operations, but the kernels round
differently at different shapes: a matrix product's rounding depends on its number of rows
(measured on CPU with MKL: a 1-row product differs from a 2-row one, which differs from 5 rows
under two threads), and attention over a cache reduces over another number of keys than a
causal forward. Inside ``batch_invariant_mode()`` every per-token reduction runs in an order
that depends on nothing but the token's own data:

- **products** (every linear layer, the output layer, the MoE router and experts): the rows are
  cut into tiles of ``ROW_TILE`` rows (the last one zero-padded) and multiplied as one batched
  product of fixed-shape [ROW_TILE, K] x [K, N] problems (N at least ``MIN_COLUMNS``); a row's
  result is that of its tile's kernel, the same at any number of rows and at any place in its
  tile (``tiled_bmm``; measured with MKL at 1 and 2 threads, tests/unit/test_batch_invariant.py).
  A ``TorchFunctionMode`` applies it to ``torch.matmul``/``mm``/``addmm``/``linear`` with a 2-D
  right operand and to ``torch._grouped_mm`` (one tiled product per group), so megatron-core's
  own layers run unchanged.
- **attention** (``causal_attention``, ``decode_attention``; the core-attention modules of
  puzzle/models/sdpa_attention.py call them in the mode): keys in blocks of ``KEY_BLOCK`` from
  each sequence's first position; the scores of a block are a tiled product, the softmax takes
  the exact maximum over the query's keys, and each block's exponentials times [value | 1] is a
  tiled product (the normaliser is its last column); the blocks are added in order. A block past
  the query's position adds an exact 0, so a decode step (keys up to the cache's longest row)
  and a full forward (keys up to the sequence's end) give the same bits.
- **sums over a row** (``row_sum``: a tiled product with a ones vector; torch's reductions split
  a long row over threads when there are few rows): the softmax normaliser of the log-probs
  (puzzle/engine/vocab_parallel.py) and the statistics of ``rms_norm``/``layer_norm``, which the
  mode computes itself.
- **transcendental elementwise functions** (exp, log, sigmoid, SiLU, GELU, tanh, cos, sin, erf):
  torch's vectorised CPU loop rounds some of them (sigmoid, SiLU) differently from its scalar
  loop, which takes a tensor's last elements and the ends of each thread's share; the mode feeds
  them an input whose innermost stride is 2, so every element takes the scalar loop.
- **tensor-parallel sums** (row-parallel layers, the vocabulary's partial sums): gathered and
  added in rank order (``ordered_all_reduce``), so that a sum over T >= 3 ranks does not follow
  the ring's chunking of the message (megatron_patches/batch_invariant_reduce.py routes megatron's
  own all-reduce there).

Additions, products and quotients of elements, the maximum and the gathers are exact per element
or per row already. The same layout (T) is needed in generation and scoring: T splits the
row-parallel reductions.

The mode costs time (tiles pad small products, attention is not a fused kernel, one more
dispatch per torch call): ``python -m puzzle.bench.generation`` and ``puzzle.bench.packing``
report it against the default. CPU only: on CUDA, cuBLAS chooses kernels by batch count as
well, so the tiles do not make the products invariant there (the GPU path needs fixed-tile
kernels, e.g. megatron-core's persistent Triton matmul, and a fixed-split attention kernel; see
docs/ppo.md); the flag is refused on CUDA.
"""

from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

#: rows per tile of every product in the mode
ROW_TILE = 16
#: keys per attention block in the mode
KEY_BLOCK = 32
#: products narrower than this get zero columns: with MKL on CPU, a one-column product of one tile
#: takes a matrix-vector kernel (of several tiles not), and 5 to 11 columns round a row by its
#: place in the tile (measured: rows 1-3 of every 4 differ from row 0); 12 and more do not
MIN_COLUMNS = 16

_depth = 0  # nesting depth of batch_invariant_mode()


def active() -> bool:
    """Whether a ``batch_invariant_mode()`` block is running."""
    return _depth > 0


# ---- products -----------------------------------------------------------------------------------
def tiled_bmm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [n, m, k] @ w [n, k, c] -> [n, m, c] with each row of x computed in a tile of ROW_TILE
    rows: one batched product of [ROW_TILE, k] x [k, c] problems whatever m is."""
    n, m, k = x.shape
    c = w.shape[-1]
    if c < MIN_COLUMNS:  # narrow products: zero columns added, see MIN_COLUMNS
        wide = torch.cat([w, w.new_zeros(*w.shape[:-1], MIN_COLUMNS - c)], dim=-1)
        return tiled_bmm(x, wide)[..., :c]
    pad = (-m) % ROW_TILE
    if pad:
        x = torch.cat([x, x.new_zeros(n, pad, k)], dim=1)
    tiles = x.shape[1] // ROW_TILE
    xt = x.reshape(n * tiles, ROW_TILE, k)
    wt = w.unsqueeze(1).expand(n, tiles, k, c).reshape(n * tiles, k, c)
    out = torch.bmm(xt, wt).view(n, tiles * ROW_TILE, c)
    return out[:, :m] if pad else out


def tiled_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., k] @ w [k, c] -> [..., c], row-invariant (``tiled_bmm``)."""
    rows = x.reshape(1, -1, x.shape[-1])
    return tiled_bmm(rows, w.unsqueeze(0)).view(*x.shape[:-1], w.shape[-1])


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """x.sum(-1) as a tiled product with a ones vector: the same bits for a row at any number of
    rows (torch's own reductions split a long row over threads when there are few rows)."""
    ones = torch.ones(x.shape[-1], 1, dtype=x.dtype, device=x.device)
    return tiled_matmul(x, ones).squeeze(-1)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm(x [N, k], w [E, k, c], offs)``: group e (rows offs[e-1]..offs[e]) times
    w[e], each group a tiled product (the group sizes are read on the host)."""
    out = x.new_zeros(x.shape[0], w.shape[-1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = tiled_matmul(x[start:end], w[e])
        start = end
    return out


def _matmul(a, b, *rest, **kwargs):
    if rest or kwargs or not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) \
            or b.dim() != 2 or a.dim() < 2 or not a.is_floating_point():
        return NotImplemented
    return tiled_matmul(a, b)


def _addmm(bias, a, b, *rest, beta=1, alpha=1, **kwargs):
    if rest or kwargs or beta != 1 or alpha != 1:
        return NotImplemented
    out = _matmul(a, b)
    return out if out is NotImplemented else out + bias


def _linear(x, weight, bias=None, *rest, **kwargs):
    if rest or kwargs or weight.dim() != 2:
        return NotImplemented
    out = tiled_matmul(x, weight.t())
    return out if bias is None else out + bias


def _grouped(x, w, *rest, offs=None, bias=None, out_dtype=None, **kwargs):
    if rest or kwargs or offs is None or bias is not None or out_dtype not in (None, x.dtype) \
            or x.dim() != 2 or w.dim() != 3:
        return NotImplemented
    return grouped_mm(x, w, offs)


# ---- elementwise functions and norms -------------------------------------------------------------
def _scalar_path(func):
    """``func`` (an elementwise function) with every element through torch's scalar loop: on an
    input whose innermost stride is not 1, torch's CPU kernels never take their vectorised loop,
    whose transcendental functions (sigmoid, SiLU, ...) round differently from the scalar ones
    and which a tensor's last elements, and a thread's share, skip."""

    def run(x, *args, **kwargs):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or "out" in kwargs \
                or kwargs.get("inplace", False) or x.device.type != "cpu":
            return NotImplemented
        strided = x.new_empty(*x.shape, 2)[..., 0]
        strided.copy_(x)
        return func(strided, *args, **kwargs)

    return run


def _rms_norm(x, normalized_shape, weight=None, eps=None):
    if len(normalized_shape) != 1 or not x.is_floating_point():
        return NotImplemented
    xf = x.float()
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    inv = 1.0 / torch.sqrt(row_sum(xf * xf) / xf.shape[-1] + eps)
    out = (xf * inv.unsqueeze(-1)).to(x.dtype)
    return out if weight is None else out * weight


def _layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    if len(normalized_shape) != 1 or not x.is_floating_point():
        return NotImplemented
    xf = x.float()
    h = xf.shape[-1]
    centred = xf - (row_sum(xf) / h).unsqueeze(-1)
    inv = 1.0 / torch.sqrt(row_sum(centred * centred) / h + eps)
    out = (centred * inv.unsqueeze(-1)).to(x.dtype)
    if weight is not None:
        out = out * weight
    return out if bias is None else out + bias


_POINTWISE = (torch.exp, torch.Tensor.exp, torch.log, torch.Tensor.log, torch.sigmoid, torch.Tensor.sigmoid,
              torch.tanh, torch.Tensor.tanh, torch.cos, torch.Tensor.cos, torch.sin, torch.Tensor.sin,
              torch.erf, torch.nn.functional.silu, torch.nn.functional.gelu)

_ROUTES = {torch.matmul: _matmul, torch.Tensor.matmul: _matmul, torch.Tensor.__matmul__: _matmul,
           torch.mm: _matmul, torch.Tensor.mm: _matmul, torch.addmm: _addmm, torch.nn.functional.linear: _linear}
if hasattr(torch, "_grouped_mm"):
    _ROUTES[torch._grouped_mm] = _grouped
_ROUTES.update({f: _scalar_path(f) for f in _POINTWISE})
_ROUTES.update({torch.nn.functional.rms_norm: _rms_norm, torch.rms_norm: _rms_norm,
                torch.nn.functional.layer_norm: _layer_norm, torch.layer_norm: _layer_norm})


class _BatchInvariantMode(TorchFunctionMode):
    """Routes the matrix products of weights (2-D right operand) to ``tiled_matmul``, the
    transcendental elementwise functions to torch's scalar loop and the norms to row-invariant
    sums."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        impl = _ROUTES.get(func)
        if impl is not None:
            out = impl(*args, **kwargs)
            if out is not NotImplemented:
                return out
        return func(*args, **kwargs)


def is_mode(mode) -> bool:
    """Whether a torch-function mode is the one ``batch_invariant_mode()`` pushes."""
    return isinstance(mode, _BatchInvariantMode)


# ---- attention ----------------------------------------------------------------------------------
def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
            scale: float) -> torch.Tensor:
    """q [b, g, Q, d] (query rows of each key group), k/v [b, g, L, d], q_pos [b, Q] long (each
    query row's position; it sees keys 0..q_pos) -> [b, g, Q, d] in q's dtype. The softmax is in
    fp32."""
    b, g, Q, d = q.shape
    L = k.shape[2]
    J = max(1, math.ceil(L / KEY_BLOCK))
    if J * KEY_BLOCK != L:
        pad = (0, 0, 0, J * KEY_BLOCK - L)
        k, v = torch.nn.functional.pad(k, pad), torch.nn.functional.pad(v, pad)
    n = b * g
    rows = q.reshape(n, Q, d)
    blocks = k.reshape(n, J, KEY_BLOCK, d)
    scores = torch.cat([tiled_bmm(rows, blocks[:, j].transpose(1, 2).contiguous()) for j in range(J)], dim=-1)
    scores = scores.view(b, g, Q, J * KEY_BLOCK).float() * scale
    keys = torch.arange(J * KEY_BLOCK, device=q.device)
    hidden = (keys.view(1, 1, -1) > q_pos.unsqueeze(-1)).unsqueeze(1)  # [b, 1, Q, J*B]
    scores = scores.masked_fill(hidden, float("-inf"))
    e = torch.exp(scores - scores.amax(dim=-1, keepdim=True)).view(n, Q, J, KEY_BLOCK)
    ve = torch.cat([v.float(), v.new_ones(*v.shape[:-1], 1, dtype=torch.float32)], dim=-1)
    ve = ve.view(n, J, KEY_BLOCK, d + 1)
    acc = None
    for j in range(J):  # blocks added in order; one past the query's position adds an exact 0
        part = tiled_bmm(e[:, :, j].contiguous(), ve[:, j])
        acc = part if acc is None else acc + part
    out = acc[..., :d] / acc[..., d:]
    return out.view(b, g, Q, d).to(q.dtype)


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                     start: int = 0) -> torch.Tensor:
    """Causal attention of b sequences: query [s, b, h, d] at positions start..start + s - 1,
    key/value [start + s, b, g, d] from the first position -> [s, b, h * d]."""
    s, b, h, d = query.shape
    g = key.shape[2]
    r = h // g
    q = query.permute(1, 2, 0, 3).reshape(b, g, r * s, d)
    k, v = key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3)
    pos = (start + torch.arange(s, device=query.device)).repeat(r).unsqueeze(0).expand(b, r * s)
    out = _attend(q, k, v, pos, scale)  # [b, g, r * s, d]
    return out.view(b, h, s, d).permute(2, 0, 1, 3).reshape(s, b, h * d)


def decode_attention(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """One new token per row against its cached keys: query [1, n, h, d], k/v [n, g, L, d] (the
    cache's rows), ``positions`` [n] (row i sees keys 0..positions[i]) -> [1, n, h * d]."""
    _, n, h, d = query.shape
    g = k.shape[1]
    q = query[0].reshape(n, g, h // g, d)
    pos = positions.view(n, 1).expand(n, h // g)
    return _attend(q, k, v, pos, scale).reshape(1, n, h * d)


def attention_problem(config) -> Optional[str]:
    """What of a model's attention the mode's attention does not compute, or None."""
    if getattr(config, "window_size", None) is not None:
        return "sliding-window attention (window_size)"
    if getattr(config, "softmax_type", "vanilla") != "vanilla":
        return f"softmax_type={config.softmax_type!r}"
    if getattr(config, "context_parallel_size", 1) != 1:
        return "context parallelism"
    return None


# ---- tensor-parallel sums -------------------------------------------------------------------------
def ordered_all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """The sum of ``x`` over ``group``'s ranks, added in rank order (the same bits on every rank
    and for every message size); in place into ``x``, which is returned."""
    size = 1 if group is None else dist.get_world_size(group)
    if size == 1:
        return x
    src = x if x.is_contiguous() else x.contiguous()
    if size == 2:  # a + b == b + a: the all-reduce is already order-free
        dist.all_reduce(src, group=group)
        return x if src is x else x.copy_(src)
    parts = [torch.empty_like(src) for _ in range(size)]
    dist.all_gather(parts, src, group=group)
    total = parts[0]
    for p in parts[1:]:
        total = total + p
    x.copy_(total)
    return x


# ---- the mode -------------------------------------------------------------------------------------
@contextlib.contextmanager
def batch_invariant_mode(enabled: bool = True):
    """Runs a block with batch-invariant products, attention, vocabulary and tensor-parallel sums
    (see the module doc); a no-op when ``enabled`` is False."""
    global _depth
    if not enabled:
        yield
        return
    from megatron_patches import batch_invariant_reduce

    _depth += 1
    saved, batch_invariant_reduce.hook = batch_invariant_reduce.hook, ordered_all_reduce
    try:
        with _BatchInvariantMode():
            yield
    finally:
        batch_invariant_reduce.hook = saved
        _depth -= 1
