"""Packed sequences (THD): rows packed without padding, attention causal within each sequence,
per-sequence results equal to each row's own computation."""

import math

import pytest
import torch

from puzzle.models.packed_attention import PackedSequences, packed_attention
from puzzle.models.sdpa_attention import sdpa_attention
from puzzle.dataflow.batch import packed_response_index
from puzzle.dataflow.micro_batching import micro_batches, pack_rows


def _causal(q, k, v):
    return sdpa_attention(q, k, v, None, q.shape[0] > 1, 1.0 / math.sqrt(q.shape[-1]))


@pytest.mark.parametrize("lengths", [[5, 3, 5, 1, 7, 3], [4, 4, 4], [9], [2, 6, 2, 2]])
def test_packed_attention_equals_each_sequence_alone(lengths):
    g = torch.Generator().manual_seed(0)
    T, h, kv, d = sum(lengths), 4, 2, 8
    q, k, v = (torch.randn(T, n, d, generator=g, requires_grad=True) for n in (h, kv, kv))
    out = packed_attention(_causal, q, k, v, PackedSequences.of(lengths))
    assert out.shape == (T, h * d)
    o = 0
    for n in lengths:
        alone = _causal(q[o:o + n, None], k[o:o + n, None], v[o:o + n, None])[:, 0]
        torch.testing.assert_close(out[o:o + n], alone, rtol=1e-6, atol=1e-6)
        o += n
    out.square().sum().backward()  # gradients flow through the gathers and the inverse order
    assert q.grad.abs().sum() > 0 and v.grad.abs().sum() > 0


def test_packed_attention_does_not_attend_across_sequences():
    lengths = [3, 4]
    q, k, v = (torch.randn(7, 2, 4) for _ in range(3))
    base = packed_attention(_causal, q, k, v, PackedSequences.of(lengths))
    k2, v2 = k.clone(), v.clone()
    k2[:3] += 10.0
    v2[:3] -= 5.0  # the first sequence's keys and values change
    moved = packed_attention(_causal, q, k2, v2, PackedSequences.of(lengths))
    assert torch.equal(base[3:], moved[3:]) and not torch.equal(base[:3], moved[:3])


def test_pack_rows_drops_padding_and_restarts_positions():
    tokens = torch.tensor([[1, 2, 3, 0, 0], [4, 5, 6, 7, 8], [9, 10, 0, 0, 0]])
    prompt, resp = torch.tensor([2, 1, 1]), torch.tensor([1, 4, 1])
    mb = pack_rows(tokens, prompt, resp, seq_multiple=4, pad_id=0)
    assert mb.tokens.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 0, 0]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 0, 1]]
    psp = mb.packed_seq_params
    assert psp.qkv_format == "thd" and psp.cu_seqlens_q.tolist() == [0, 3, 8, 10, 12]
    assert psp.cu_seqlens_q.dtype == torch.int32 and psp.max_seqlen_q == 5
    assert mb.seq_starts.tolist() == [0, 3, 8]
    # response token k of row b is predicted at start_b + P_b + k - 1
    idx = packed_response_index(mb.seq_starts, prompt, 2, 11)
    assert idx[:, 0].tolist() == [1, 3, 8]


def test_empty_sequence_is_refused():
    with pytest.raises(ValueError, match="at least one token"):
        PackedSequences.of([3, 0])


def test_thd_rope_with_cached_cos_sin_equals_megatrons_bit_for_bit():
    """megatron_patches.rope_thd_cached: query and key of packed sequences rotated exactly as
    megatron's THD RoPE rotates them (values and gradients), the cos/sin built once per pair of
    (cu_seqlens, frequencies) tensors and rebuilt for new ones."""
    from types import SimpleNamespace

    import megatron_patches
    from megatron.core.models.common.embeddings import rope_utils
    from megatron_patches import rope_thd_cached

    megatron_patches.apply()
    cfg = SimpleNamespace(apply_rope_fusion=False, multi_latent_attention=False, rotary_interleaved=False)
    cp = SimpleNamespace(size=lambda: 1, rank=lambda: 0)
    g = torch.Generator().manual_seed(0)
    for lengths, rot in (([5, 3, 5, 1], 8), ([4, 4, 4], 8), ([6, 2], 4)):
        cu = PackedSequences.of(lengths).cu_seqlens_q
        freqs = torch.randn(max(lengths), 1, 1, rot, generator=g)
        ours, theirs = (torch.randn(sum(lengths), 3, 8, generator=g).requires_grad_() for _ in range(2))
        with torch.no_grad():
            theirs.copy_(ours)
        for _ in range(2):  # the second call reads the cache (the key's call in an attention)
            a = rope_thd_cached.apply_rotary_pos_emb(ours, freqs, cfg, cu_seqlens=cu, mscale=1.5, cp_group=cp)
            b = rope_utils.apply_rotary_pos_emb(theirs, freqs, cfg, cu_seqlens=cu, mscale=1.5, cp_group=cp)
            assert a.shape == b.shape and torch.equal(a, b)
            (a * b.detach()).sum().backward()
            (b * b.detach()).sum().backward()
            assert torch.equal(ours.grad, theirs.grad)
    assert rope_thd_cached._cache["key"][0]() is cu  # cached for the last micro-batch's tensors


def test_schedule_shape_runs_equal_packed_sequences_as_a_dense_batch():
    from puzzle.dataflow.batch import RolloutBatch
    from puzzle.dataflow.micro_batching import schedule_shape

    tokens = torch.arange(4 * 8).reshape(4, 8)
    equal = RolloutBatch(tokens, torch.full((4,), 3), torch.full((4,), 5), 5)
    mbs = micro_batches(equal, 2, packed=True)
    assert schedule_shape(mbs, True, 8, 2) == (8, 2, False)  # each micro-batch: 2 sequences of 8
    assert all(mb.dense_shape == (2, 8) for mb in mbs)
    assert mbs[1].tokens.view(2, 8).tolist() == tokens[2:].tolist()  # rows in packed order
    mbs = micro_batches(equal, 2, packed=True)
    assert schedule_shape(mbs, True, 8, 2, seq_multiple=3) == (16, 1, False)  # 8 % 3: THD
    assert all(mb.dense_shape is None for mb in mbs)
    mixed = RolloutBatch(tokens, torch.full((4,), 3), torch.tensor([5, 5, 2, 5]), 5)
    mbs = micro_batches(mixed, 2, packed=True)
    assert schedule_shape(mbs, True, 8, 2) == (16, 1, True)  # packed [1, T] of 16 and 13 tokens
    assert all(mb.dense_shape is None for mb in mbs)
    assert schedule_shape(micro_batches(mixed, 2), False, 8, 2) == (8, 2, False)  # right-padded


# ---- the GPU's one-call path (torch's flash-attention varlen kernel), its plumbing on the CPU ----
def _reference_varlen_kernel(calls):
    """Stands in for the flash kernel on the CPU: causal attention within each sequence of
    ``cu_seqlens``, written out with an explicit mask, query heads grouped over key heads."""
    def kernel(q, k, v, cu, max_len, scale):
        calls.append((cu.clone(), cu.dtype, max_len, scale))
        r = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
        out = []
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            s = torch.einsum("qhd,khd->hqk", q[a:b], k[a:b]) * scale
            s = s.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))
            out.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v[a:b]))
        return torch.cat(out)
    return kernel


def test_varlen_flash_attention_hands_the_kernel_the_packed_sequences(monkeypatch):
    """One kernel call per micro-batch: the sequences' int32 offsets and longest length, the
    core attention's scale, non-contiguous heads made contiguous; [T, h * d] back, gradients too."""
    import puzzle.models.packed_attention as pa

    calls = []
    monkeypatch.setattr(pa, "flash_varlen_kernel", _reference_varlen_kernel(calls))
    lengths, h, kv, d = [5, 3, 7, 1], 4, 2, 8
    g = torch.Generator().manual_seed(1)
    q = torch.randn(d, sum(lengths), h, generator=g).permute(1, 2, 0).requires_grad_()  # stride(-1) != 1
    k, v = (torch.randn(sum(lengths), kv, d, generator=g, requires_grad=True) for _ in range(2))
    packed = PackedSequences.of(lengths)
    out = pa.varlen_flash_attention(q, k, v, packed, 1.0 / math.sqrt(d))
    (cu, dtype, max_len, scale), = calls
    assert cu.tolist() == [0, 5, 8, 15, 16] and dtype == torch.int32 and max_len == 7
    assert scale == pytest.approx(1.0 / math.sqrt(d))
    torch.testing.assert_close(out, packed_attention(_causal, q, k, v, packed), rtol=1e-6, atol=1e-6)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref = torch.autograd.grad(packed_attention(_causal, q, k, v, packed).square().sum(), (q, k, v))
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="16 tokens but the sequences hold 15"):
        pa.varlen_flash_attention(q, k, v, PackedSequences.of([5, 3, 7]), 1.0)


def test_sdpa_core_attention_takes_the_one_call_path_where_the_kernel_applies(monkeypatch):
    """SDPACoreAttention's packed forward goes to the varlen kernel when it applies and to the
    per-length calls otherwise (the CPU: CUDA tensors only)."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    import puzzle.models.packed_attention as pa
    import puzzle.models.sdpa_attention as sa

    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                            attention_dropout=0.0)
    attention = sa.SDPACoreAttention(cfg, 1, AttnMaskType.causal, "self")
    lengths = [6, 2, 6]
    q, k, v = (torch.randn(sum(lengths), n, 8) for n in (4, 2, 2))
    packed = PackedSequences.of(lengths)
    assert not pa.varlen_flash_usable(q.bfloat16(), k.bfloat16(), 0.0)  # CPU tensors
    per_length = attention(q, k, v, None, packed_seq_params=packed)
    calls = []
    monkeypatch.setattr(pa, "flash_varlen_kernel", _reference_varlen_kernel(calls))
    monkeypatch.setattr(sa, "varlen_flash_usable", lambda query, key, dropout_p: dropout_p == 0.0)
    one_call = attention(q, k, v, None, packed_seq_params=packed)
    assert len(calls) == 1 and calls[0][2] == 6
    torch.testing.assert_close(one_call, per_length, rtol=1e-6, atol=1e-6)
