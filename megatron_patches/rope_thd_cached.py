"""Patch: megatron-core's unfused RoPE on packed (THD) sequences builds its cos/sin once per model
forward instead of once per attention call.

Target: the name ``apply_rotary_pos_emb`` in ``megatron.core.transformer.attention`` (what
``Attention.forward`` calls on the query and the key), checked on megatron-core 0.16.0 and 0.16.1.

Reason: with ``cu_seqlens`` and without the fused kernel (every CPU machine, GPU machines without
transformer-engine's RoPE fusion), ``rope_utils._apply_rotary_pos_emb_thd`` turns ``cu_seqlens``
into a host list, splits the input per sequence, concatenates the sequences' frequency slices and
takes their cos and sin: the same work, on the same tensors, for the query and the key of every
layer of a micro-batch. The patch computes the concatenated frequencies and their cos/sin exactly
as megatron does (same ops on the same tensor, so the same bits) once per (cu_seqlens,
frequencies) pair and reuses them while the pair is the one of the running micro-batch; the
rotation is megatron's, without its concatenation with an empty pass-through part. Every other
case (no cu_seqlens, RoPE fusion, context parallelism, multi-latent attention, frequencies with
gradients) goes to megatron's function unchanged.

Remove when: megatron-core applies THD RoPE without per-call host syncs and recomputation.
"""

from __future__ import annotations

import weakref

_applied = False
_original = None
#: (weakref cu_seqlens, its version, weakref freqs, its version, mscale, dtype) -> (cos, sin)
_cache = {"key": None, "value": None}


def _cos_sin(cu_seqlens, freqs, mscale: float, dtype):
    """megatron's packed frequencies [T, 1, 1, d] of the sequences of ``cu_seqlens`` and their
    ``(cos * mscale, sin * mscale)`` in ``dtype``, built as ``_apply_rotary_pos_emb_thd`` builds
    them (cp size 1), cached for the next call with the same tensors."""
    import torch

    key = (cu_seqlens._version, freqs._version, float(mscale), dtype)
    cached = _cache["key"]
    if cached is not None and cached[0]() is cu_seqlens and cached[1]() is freqs and cached[2] == key:
        return _cache["value"]
    seqlens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    if freqs.dim() >= 1 and freqs.size(0) == cu_seqlens[-1]:  # positions over the whole batch
        starts = cu_seqlens[:-1].tolist()
        packed = torch.cat([freqs[s:s + n] for s, n in zip(starts, seqlens)], dim=0)
    else:  # positions restart at 0 in every sequence
        packed = torch.cat([freqs[:n] for n in seqlens], dim=0)
    value = ((torch.cos(packed) * mscale).to(dtype), (torch.sin(packed) * mscale).to(dtype))
    _cache["key"] = (weakref.ref(cu_seqlens), weakref.ref(freqs), key)
    _cache["value"] = value
    return value


def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale: float = 1.0, cp_group=None):
    """megatron's ``apply_rotary_pos_emb``; THD inputs (cp size 1, unfused) use the cached cos/sin."""
    if (cu_seqlens is None or config.apply_rope_fusion or config.multi_latent_attention
            or cp_group is None or cp_group.size() != 1 or freqs.requires_grad):
        return _original(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)
    import torch
    from megatron.core.models.common.embeddings import rope_utils

    cos_, sin_ = _cos_sin(cu_seqlens, freqs, mscale, t.dtype)
    x = t.unsqueeze(1)  # [T, 1, h, d], as megatron's THD path hands it to its BSHD rotation
    rot_dim = freqs.shape[-1]
    rot, passed = x[..., :rot_dim], x[..., rot_dim:]
    out = (rot * cos_) + (rope_utils._rotate_half(rot, config.rotary_interleaved) * sin_)
    if passed.shape[-1]:
        out = torch.cat((out, passed), dim=-1)
    return out.squeeze(1)


def apply() -> None:
    global _applied, _original
    if _applied:
        return
    from megatron.core.transformer import attention

    _original = attention.apply_rotary_pos_emb
    attention.apply_rotary_pos_emb = apply_rotary_pos_emb
    _applied = True
