"""Llama-3.x RoPE frequency scaling with all four of its parameters (pure torch).

megatron-core 0.16's ``RotaryEmbedding(rope_scaling=True, rope_scaling_factor=f)`` applies the
llama3 scaling with ``low_freq_factor=1``, ``high_freq_factor=4`` and
``original_max_position_embeddings=8192`` fixed. Checkpoints may set other values (HF
``rope_parameters``), so puzzle computes the inverse frequencies itself and puts them in the
model's ``rotary_pos_emb.inv_freq`` right after GPTModel is built (megatron reads that tensor on
every forward; its per-length cache is empty until the first one). No megatron patch is needed.
"""

from __future__ import annotations

import math

import torch


def rope_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    """Plain RoPE inverse frequencies ``1 / base^(2i/d)`` (fp32), as megatron and HF compute them."""
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def llama3_inv_freq(head_dim: int, base: float, factor: float, low_freq_factor: float,
                    high_freq_factor: float, original_max_position_embeddings: int) -> torch.Tensor:
    """Inverse frequencies of HF rope_type "llama3": wavelengths longer than
    ``original / low_freq_factor`` are divided by ``factor``, shorter than
    ``original / high_freq_factor`` kept, and the band in between interpolated smoothly."""
    inv = rope_inv_freq(head_dim, base)
    low_wavelen = original_max_position_embeddings / low_freq_factor
    high_wavelen = original_max_position_embeddings / high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def arch_inv_freq(arch) -> torch.Tensor:
    """The inverse frequencies of a ModelArch's RoPE (scaled when ``arch.use_rope_scaling``)."""
    if not arch.use_rope_scaling:
        return rope_inv_freq(arch.kv_channels, arch.rotary_base)
    return llama3_inv_freq(arch.kv_channels, arch.rotary_base, arch.rope_scaling_factor,
                           arch.rope_low_freq_factor, arch.rope_high_freq_factor,
                           arch.rope_original_max_position_embeddings)


def apply_rope_scaling(model, arch) -> None:
    """Replace a freshly built GPTModel's RoPE inverse frequencies by ``arch``'s llama3-scaled ones."""
    if not arch.use_rope_scaling:
        return
    rope = getattr(model, "rotary_pos_emb", None)
    if rope is None or not hasattr(rope, "inv_freq"):
        raise RuntimeError("use_rope_scaling: the model has no rotary_pos_emb.inv_freq to scale")
    rope.inv_freq = arch_inv_freq(arch).to(device=rope.inv_freq.device, dtype=rope.inv_freq.dtype)
    clear = getattr(type(rope).forward, "cache_clear", None)
    if clear is not None:
        clear()  # megatron caches forward(max_seq_len) per instance
