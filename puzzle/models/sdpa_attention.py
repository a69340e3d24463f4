"""Core attention on ``torch.nn.functional.scaled_dot_product_attention``, and the KV cache that
generation binds to every core-attention module.

``SDPACoreAttention`` is a drop-in for megatron-core's ``DotProductAttention`` in the local layer
spec (same constructor and forward signature: query [sq, b, h, d], key/value [sk, b, g, d],
``attention_mask`` bool True = masked, ``attn_mask_type``; returns [sq, b, h * d]). Grouped-query
attention never materialises repeated keys and values: SDPA's ``enable_gqa`` (torch >= 2.5), or
the h / g query heads of a group folded into the query-length dimension.
Both CPU core attentions (``SDPACoreAttention`` and ``UnfusedCoreAttention``) take packed
sequences (megatron's THD ``packed_seq_params``): causal attention within each sequence, one call
per distinct length (puzzle/models/packed_attention.py); on a GPU, ``SDPACoreAttention`` runs a
packed micro-batch as one call of torch's flash-attention varlen kernel where it applies.

Generation (puzzle/rollout/generation.py) binds a ``StaticKVCache`` to the modules for one model
call (``module.kv_cache = cache``): megatron's Attention then runs with ``inference_context=None``
(it applies RoPE with the per-row positions generation gives it) and the core attention writes
the new keys and values into the cache in place, at each row's own positions, and reads the
rows' keys back from it. Every row has its own length, so a finished row's slot can take a new
prompt while the other rows keep decoding (continuous batching in a static cache). The cache
works with every backend: ``UnfusedCoreAttention`` (megatron's own ``DotProductAttention`` math,
bit for bit unchanged when no cache is bound) and TE's attention (decode with SDPA math).
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from puzzle.models import batch_invariant
from puzzle.models.packed_attention import packed_attention, varlen_flash_attention, varlen_flash_usable

_HAS_ENABLE_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


class StaticKVCache:
    """Keys and values of ``slots`` rows up to ``width`` positions, for every layer of one model.

    Buffers are [slots, g, width, d] per layer (megatron's layer_number, global over pipeline
    stages), allocated at the first write with the key's dtype and device. Before each model call
    generation sets the call: ``prefill(slots, lengths, starts=None)`` (segments packed into one
    sequence, no padding: segment i fills slot ``slots[i]`` at positions starts[i]..starts[i] +
    lengths[i] - 1 and attends causally over its own keys and, when it starts past 0 (tokens
    appended to a kept row: a multi-turn observation), over the slot's cached keys before it) or
    ``decode(n, pos, key_len)`` (slots 0..n-1, one new token per row written at ``pos`` [n]; a
    row attends to its positions <= pos over the first ``key_len`` positions). Writes are one
    ``index_copy_`` per buffer, at flat indices computed once per call.
    """

    def __init__(self, slots: int, width: int):
        self.slots, self.width = slots, width
        self.buffers: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        self.rows: Optional[torch.Tensor] = None
        self.pos: Optional[torch.Tensor] = None
        self.n = 0
        self.key_len = 0
        self.masked: Optional[torch.Tensor] = None  # [n, 1, 1, key_len] True = masked
        self.bias: Optional[torch.Tensor] = None    # the same as an additive mask (lowest value)
        self.rope: Optional[Tuple[torch.Tensor, torch.Tensor]] = None  # (cos, sin) of the call
        self.write_index: Optional[torch.Tensor] = None  # flat rows the call writes
        self.segments: List[Tuple[int, int]] = []    # prefill: (offset, length) of each segment
        self.starts: List[int] = []                  # prefill: cache position of each segment's first token
        self.slot_list: List[int] = []               # prefill: the slot of each segment
        self.layer_buffers = None                    # prefill: (keys, values) of the layer being run
        self._token_slot: Optional[torch.Tensor] = None  # prefill: [T] slot of each token
        #: prefill attention as one batched call over the prompts padded to the longest (the
        #: default on CUDA, where it runs flash kernels) instead of one call per prompt (CPU)
        self.batch_prefill: Optional[bool] = None
        self._padded: Optional[torch.Tensor] = None

    def prefill(self, slots: List[int], lengths: List[int], device=None, starts: Optional[List[int]] = None) -> None:
        """Segments of ``lengths`` tokens, packed in that order, into ``slots`` from cache
        positions ``starts`` (default 0: new prompts) (built on the host and copied once: no
        device reads)."""
        starts = list(starts) if starts is not None else [0] * len(lengths)
        end = max(s + n for s, n in zip(starts, lengths))
        if end > self.width:
            raise ValueError(f"prompt of {end} tokens exceeds the cache width {self.width}")
        self.n, self.key_len, self.starts = 0, max(lengths), starts
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        self.segments = list(zip(offsets[:-1], lengths))
        z = dict(dtype=torch.long, device=device)
        self.rows = torch.tensor(slots, **z)
        self.slot_list = list(slots)
        self._token_slot = torch.tensor([s for s, n in zip(slots, lengths) for _ in range(n)], **z)
        self.pos = torch.tensor([s + p for s, n in zip(starts, lengths) for p in range(n)], **z)
        self.write_index = None
        self._padded = None  # [T] place of each packed token in the prompts padded to the longest
        batched = self.batch_prefill if self.batch_prefill is not None else \
            torch.device(device or "cpu").type == "cuda"
        if batched and len(lengths) > 1 and not any(starts):
            longest = max(lengths)
            self._padded = torch.tensor([i * longest + p for i, n in enumerate(lengths) for p in range(n)], **z)

    def decode(self, n: int, pos: torch.Tensor, key_len: int) -> None:
        """``pos`` [n] long: the position each row writes; ``key_len`` > max(pos)."""
        self.rows, self.n, self.pos, self.key_len = None, n, pos, key_len
        slots = torch.arange(key_len, device=pos.device)
        self.masked = (slots.unsqueeze(0) > pos.unsqueeze(1))[:, None, None, :]
        self.bias = None
        self.write_index = None

    def _write_index(self, groups: int) -> torch.Tensor:
        """Rows of a layer buffer viewed as [slots * groups * width, d] that the call writes, one
        per (token, group): (slot, group j, the token's position); computed once per call."""
        if self.write_index is None:
            g = torch.arange(groups, device=self.pos.device)
            if self.is_prefill:
                rows = self._token_slot.unsqueeze(1) * groups + g  # [T, g]
            else:
                rows = torch.arange(self.n, device=self.pos.device).unsqueeze(1) * groups + g
            self.write_index = (rows * self.width + self.pos.unsqueeze(1)).view(-1)
        return self.write_index

    def prefill_attention(self, attend, query, key, value, attend_after=None) -> torch.Tensor:
        """Causal attention of every packed segment: ``attend(q, k, v)`` on a new prompt's
        [l, 1, heads, d] slices -> [l, 1, h * d]; ``attend_after(q, k, v, start)`` on an appended
        segment's queries [l, 1, h, d] and its slot's cached keys/values [start + l, 1, g, d]
        (query i sees keys 0..start + i); concatenated -> [T, 1, h * d]."""
        if not any(self.starts):
            if len(self.segments) == 1:
                return attend(query, key, value)
            if self._padded is not None:
                return self._batched_prefill_attention(attend, query, key, value)
        if any(self.starts) and attend_after is None:
            raise ValueError("this attention cannot append tokens to a kept KV-cache row")
        out = []
        for (o, n), start, slot in zip(self.segments, self.starts, self.slot_list):
            if not start:
                out.append(attend(query[o:o + n], key[o:o + n], value[o:o + n]))
                continue
            kb, vb = self.layer_buffers  # [slots, g, width, d]: the row's keys, the new ones written
            k, v = (b[slot, :, :start + n].transpose(0, 1).unsqueeze(1) for b in (kb, vb))
            out.append(attend_after(query[o:o + n], k, v, start))
        return torch.cat(out, dim=0)

    def _batched_prefill_attention(self, attend, query, key, value) -> torch.Tensor:
        """The packed prompts scattered into a [longest, prompts] batch (zeros after each
        prompt: causal queries never see them), one ``attend`` call, gathered back."""
        k, s, index = len(self.segments), self.key_len, self._padded

        def padded(t):  # [T, 1, heads, d] -> [s, k, heads, d]
            out = t.new_zeros(k * s, *t.shape[2:])
            out.index_copy_(0, index, t[:, 0])
            return out.view(k, s, *t.shape[2:]).transpose(0, 1)

        out = attend(padded(query), padded(key), padded(value))  # [s, k, h * d]
        return out.transpose(0, 1).reshape(k * s, -1).index_select(0, index).unsqueeze(1)

    def decode_bias(self, dtype) -> torch.Tensor:
        """The decode mask as an additive float mask (SDPA's CPU kernels are faster with it)."""
        if self.bias is None or self.bias.dtype != dtype:
            bias = torch.zeros(self.masked.shape, dtype=dtype, device=self.masked.device)
            self.bias = bias.masked_fill_(self.masked, torch.finfo(dtype).min)
        return self.bias

    @property
    def is_prefill(self) -> bool:
        return self.rows is not None

    def _layer(self, layer: int, key: torch.Tensor):
        buf = self.buffers.get(layer)
        if buf is None:
            shape = (self.slots, key.shape[2], self.width, key.shape[3])
            buf = (torch.zeros(shape, dtype=key.dtype, device=key.device),
                   torch.zeros(shape, dtype=key.dtype, device=key.device))
            self.buffers[layer] = buf
        return buf

    def set_rope(self, cos: Optional[torch.Tensor], sin: Optional[torch.Tensor]) -> None:
        """RoPE of the call's positions ([T, 1, 1, d] prefill, [1, n, 1, d] decode), computed once
        per call for all layers (megatron's Attention then gets no rotary embedding). The sine is
        kept with its first half negated (see ``_rotate``)."""
        if cos is None:
            self.rope = None
            return
        s1, s2 = torch.chunk(sin, 2, dim=-1)
        self.rope = (cos, torch.cat((-s1, s2), dim=-1))

    def _rotate(self, t: torch.Tensor) -> torch.Tensor:
        """megatron's unfused RoPE (non-interleaved, full rotary dim), bit for bit:
        ``t * cos + cat(-x2, x1) * sin`` with ``cat(-x2, x1) * sin == roll(t) * cat(-s1, s2)``
        (a negation is exact), one roll instead of chunk, neg and cat per tensor."""
        cos, sin = self.rope
        if cos.dtype != t.dtype:
            cos, sin = cos.to(t.dtype), sin.to(t.dtype)
            self.rope = (cos, sin)
        return (t * cos) + (t.roll(t.shape[-1] // 2, dims=-1) * sin)

    def store(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor):
        """RoPE on query/key (when set), key/value [s, b, g, d] written in place (prefill: the
        packed prompts [T, 1, g, d]; decode: [1, n, g, d]); returns the query and what it attends
        to: prefill (key, value) as given, decode views [n, g, key_len, d] of the cache."""
        if self.rope is not None:
            query, key = self._rotate(query), self._rotate(key)
        kb, vb = self._layer(layer, key)
        g, d = key.shape[2], key.shape[3]
        if not self.is_prefill and torch.compiler.is_compiling():
            # in place on the buffers themselves: a compiled index_copy_ into a view of them
            # becomes a copy of the whole buffer per layer and step
            rows = torch.arange(self.n, device=key.device)
            kb[rows, :, self.pos] = key[0]
            vb[rows, :, self.pos] = value[0]
        else:
            index = self._write_index(g)
            kb.view(-1, d).index_copy_(0, index, key.reshape(-1, d))
            vb.view(-1, d).index_copy_(0, index, value.reshape(-1, d))
        if self.is_prefill:
            self.layer_buffers = (kb, vb)
            return query, key, value
        return query, kb[:self.n, :, :self.key_len], vb[:self.n, :, :self.key_len]


def appended_mask(queries: int, start: int, device) -> torch.Tensor:
    """[1, 1, queries, start + queries] bool, True = masked: query i (at position start + i) sees
    keys 0..start + i."""
    keys = torch.arange(start + queries, device=device)
    return (keys.unsqueeze(0) > (start + torch.arange(queries, device=device)).unsqueeze(1))[None, None]


class KVCacheMixin:
    """``kv_cache``: the StaticKVCache of the running generation call (None otherwise)."""

    kv_cache: Optional[StaticKVCache] = None

    def _cached(self, query, key, value):
        return self.kv_cache.store(self.layer_number, query, key, value)


def sdpa_decode(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                scale: float) -> torch.Tensor:
    """One new token per row against cached keys, grouped-query without repeated K/V.

    query [1, n, h, d]; k, v [n, g, L, d]; bias [n, 1, 1, L] additive -> [1, n, h * d]. The h / g query
    heads of a group are folded into SDPA's query-length dimension.
    """
    _, n, h, d = query.shape
    g = k.shape[1]
    q = query[0].reshape(n, g, h // g, d)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
    return out.reshape(1, n, h * d)


def sdpa_attention(query, key, value, mask: Optional[torch.Tensor], causal: bool, scale: float,
                   dropout_p: float = 0.0) -> torch.Tensor:
    """query [sq, b, h, d], key/value [sk, b, g, d]; ``mask`` bool True = masked, broadcastable to
    [b, 1, sq, sk]; ``causal`` applies only without a mask. -> [sq, b, h * d].

    A masked key gets the dtype's lowest value, not -inf, so a fully masked query row (a padded
    position) stays finite and uniform, as in megatron's unfused softmax. Unlike megatron's
    masked_fill, the additive mask lets such a row's gradient reach its scores; puzzle's losses
    never read a position without a key to attend to.
    """
    sq, b, h, d = query.shape
    g = key.shape[2]
    q, k, v = query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3)
    bias = None
    if mask is not None:
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device)
        bias.masked_fill_(mask, torch.finfo(q.dtype).min)
        causal = False
    if h != g and not _HAS_ENABLE_GQA:  # fold the heads of a group into the query length
        r = h // g
        q = q.reshape(b, g, r * sq, d)
        if bias is None and causal:
            bias = torch.full((sq, key.shape[0]), torch.finfo(q.dtype).min, dtype=q.dtype,
                              device=q.device).triu(1)
            causal = False
        if bias is not None:
            bias = bias.expand(b, 1, sq, key.shape[0]).repeat(1, 1, r, 1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p,
                                             is_causal=causal, scale=scale)
        out = out.reshape(b, h, sq, d)
    else:
        kw = {"enable_gqa": True} if h != g else {}
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=dropout_p,
                                             is_causal=causal, scale=scale, **kw)
    return out.permute(2, 0, 1, 3).reshape(sq, b, h * d)


def _softmax_scale(config, softmax_scale: Optional[float]) -> float:
    if softmax_scale is not None:
        return float(softmax_scale)
    return 1.0 / math.sqrt(config.kv_channels)


class SDPACoreAttention(KVCacheMixin, MegatronModule):
    """megatron core attention (local spec) on torch SDPA; see the module docstring."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None):
        super().__init__(config=config)
        if getattr(config, "context_parallel_size", 1) != 1:
            raise ValueError("--attention-backend local (SDPA) does not support context parallelism")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        self.scale = _softmax_scale(config, softmax_scale)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        # the model's own tensor-parallel group: megatron's sharded_state_dict reads it (no
        # parameters here), else falls back to the global group that puzzle never initialises
        self.tp_group = getattr(pg_collection, "tp", None)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("--attention-backend local (SDPA) does not support an attention bias")
        if batch_invariant.active():
            return invariant_attention(self, self.scale, query, key, value, attention_mask, attn_mask_type,
                                       packed_seq_params)
        if self.kv_cache is not None:
            return cached_sdpa(self, query, key, value)
        kind = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if packed_seq_params is not None:  # THD: causal within each sequence
            if kind != AttnMaskType.causal:
                raise ValueError("packed sequences need causal attention")
            if varlen_flash_usable(query, key, self.dropout_p if self.training else 0.0):
                return varlen_flash_attention(query, key, value, packed_seq_params, self.scale)
            return self._dropout_scope(lambda: packed_attention(
                lambda q, k, v: self._attend(q, k, v, None, q.shape[0] > 1), query, key, value,
                packed_seq_params))
        causal = kind == AttnMaskType.causal and query.shape[0] > 1
        return self._dropout_scope(lambda: self._attend(query, key, value, attention_mask, causal))

    def _attend(self, query, key, value, mask, causal):
        p = self.dropout_p if self.training else 0.0
        return sdpa_attention(query, key, value, mask, causal, self.scale, p)

    def _dropout_scope(self, run):
        if not (self.training and self.dropout_p > 0):
            return run()
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        with get_cuda_rng_tracker().fork():  # dropout differs across TP ranks, as in megatron
            return run()


def cached_sdpa(module, query, key, value):
    """The KV-cache path of a core-attention module, with SDPA math."""
    query, k, v = module._cached(query, key, value)
    cache = module.kv_cache
    if cache.is_prefill:
        return cache.prefill_attention(
            lambda q, k_, v_: sdpa_attention(q, k_, v_, None, q.shape[0] > 1, module.scale), query, k, v,
            lambda q, k_, v_, start: sdpa_attention(q, k_, v_, appended_mask(q.shape[0], start, q.device), False,
                                                   module.scale))
    return sdpa_decode(query, k, v, cache.decode_bias(query.dtype), module.scale)


def invariant_attention(module, scale: float, query, key, value, attention_mask, attn_mask_type,
                        packed_seq_params):
    """A core-attention module's forward in ``--batch-invariant-mode`` (puzzle/models/
    batch_invariant.py): the bound KV cache's prefill and decode, packed and dense causal
    forwards, all with the mode's attention."""
    problem = batch_invariant.attention_problem(module.config)
    if problem is not None:
        raise ValueError(f"--batch-invariant-mode does not cover {problem}")
    cache = module.kv_cache

    def attend(q, k, v):
        return batch_invariant.causal_attention(q, k, v, scale)

    if cache is not None:
        query, k, v = module._cached(query, key, value)
        if cache.is_prefill:
            return cache.prefill_attention(attend, query, k, v, lambda q, k_, v_, start:
                                           batch_invariant.causal_attention(q, k_, v_, scale, start=start))
        return batch_invariant.decode_attention(query, k, v, cache.pos, scale)
    kind = module.attn_mask_type if attn_mask_type is None else attn_mask_type
    if kind != AttnMaskType.causal or attention_mask is not None or query.shape[0] != key.shape[0]:
        raise ValueError("--batch-invariant-mode computes causal self-attention without an explicit mask "
                         f"(got mask type {kind}, mask {'given' if attention_mask is not None else 'none'})")
    if packed_seq_params is not None:
        return packed_attention(attend, query, key, value, packed_seq_params)
    return attend(query, key, value)


class UnfusedCoreAttention(KVCacheMixin, DotProductAttention):
    """megatron-core's DotProductAttention (the unfused backend) with the generation KV cache.

    Without a bound cache its forward is megatron's, unchanged.
    """

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        cache = self.kv_cache
        if batch_invariant.active():
            if attention_bias is not None or self.softmax_offset is not None:
                raise ValueError("--batch-invariant-mode: the attention has a bias or a softmax offset")
            return invariant_attention(self, self.softmax_scale, query, key, value, attention_mask,
                                       attn_mask_type, packed_seq_params)
        if cache is None and packed_seq_params is not None:  # THD: causal within each sequence
            return packed_attention(self._causal_batch, query, key, value, packed_seq_params)
        if cache is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias,
                                   packed_seq_params=packed_seq_params)
        query, k, v = self._cached(query, key, value)
        if cache.is_prefill:
            return cache.prefill_attention(self._causal, query, k, v, self._after)
        k = k.permute(2, 0, 1, 3).contiguous()
        v = v.permute(2, 0, 1, 3).contiguous()
        return super().forward(query, k, v, cache.masked, attn_mask_type=AttnMaskType.padding)

    def _causal_batch(self, query, key, value):
        """megatron's causal attention (its own mask) on [s, b, heads, d] sequences of one length
        (made contiguous: megatron views them as [s, b * heads, d])."""
        query, key, value = (t.contiguous() for t in (query, key, value))
        return super().forward(query, key, value, None, attn_mask_type=AttnMaskType.causal)

    def _after(self, query, key, value, start: int):
        """Appended tokens [l, 1, h, d] over their row's cached keys [start + l, 1, g, d]."""
        mask = appended_mask(query.shape[0], start, query.device)
        return super().forward(query.contiguous(), key.contiguous(), value.contiguous(), mask,
                               attn_mask_type=AttnMaskType.padding)

    def _causal(self, query, key, value):
        s = query.shape[0]
        causal = torch.ones(s, s, dtype=torch.bool, device=query.device).triu(1)
        return super().forward(query, key, value, causal[None, None], attn_mask_type=AttnMaskType.causal)


def with_kv_cache(cls):
    """A subclass of a core-attention class (TE's) whose KV-cache path uses SDPA math."""

    class _Cached(KVCacheMixin, cls):
        def __init__(self, config, layer_number, attn_mask_type, attention_type,
                     attention_dropout=None, softmax_scale=None, **kwargs):
            super().__init__(config, layer_number, attn_mask_type, attention_type,
                             attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                             **kwargs)
            self.layer_number = layer_number
            self.scale = _softmax_scale(config, softmax_scale)

        def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                    attention_bias=None, packed_seq_params=None):
            if self.kv_cache is not None:
                return cached_sdpa(self, query, key, value)
            return super().forward(query, key, value, attention_mask,
                                   attn_mask_type=attn_mask_type, attention_bias=attention_bias,
                                   packed_seq_params=packed_seq_params)

    _Cached.__name__ = _Cached.__qualname__ = f"KVCached{cls.__name__}"
    return _Cached
