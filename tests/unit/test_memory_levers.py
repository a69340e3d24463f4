"""The memory levers of long sequences: their flags (Megatron-LM's names and meanings)."""

import pytest
import torch

from puzzle.arguments import ArgumentError, parse_args, validate_args
from puzzle.config import Recompute
from tests.unit.test_arguments import BASE


def _cfg(*extra, world=4):
    return validate_args(parse_args(BASE + list(extra)), world, 259)


def test_recompute_flags():
    assert _cfg().recompute == Recompute()
    assert _cfg("--recompute-activations").recompute == Recompute("selective")  # Megatron-LM's alias
    assert _cfg("--recompute-granularity", "selective").recompute == Recompute("selective")
    full = ["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2"]
    assert _cfg(*full).recompute == Recompute("full", "block", 2)
    bad = [
        (["--recompute-granularity", "full"], "^--recompute-method: --recompute-granularity full needs"),
        (["--recompute-granularity", "full", "--recompute-method", "uniform"],
         "^--recompute-num-layers: --recompute-granularity full needs --recompute-num-layers N"),
        (["--recompute-method", "uniform"], "^--recompute-method: needs --recompute-granularity full"),
        (["--recompute-activations", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
         "^--recompute-method: needs --recompute-granularity full"),
        (["--recompute-activations", "--recompute-granularity", "full"],
         "--recompute-activations means --recompute-granularity selective"),
        (full[:4] + ["--recompute-num-layers", "0"], "^--recompute-num-layers: must be >= 1"),
        (full[:4] + ["--recompute-num-layers", "3"], "^--recompute-num-layers: 3 exceeds the actor's 2 layers"),
    ]
    for extra, message in bad:
        with pytest.raises(ArgumentError, match=message):
            _cfg(*extra)


def _logprobs_and_grads(logits, targets, chunk, with_entropy=True, temperature=0.7):
    from puzzle.training.vocab_parallel import logprobs_in_chunks, vocab_parallel_logprobs

    x = logits.detach().clone().requires_grad_(True)
    if chunk is None:
        out = vocab_parallel_logprobs(x, targets, None, 90, temperature, with_entropy)
    else:
        out = logprobs_in_chunks(x, targets, None, 90, temperature, with_entropy, chunk)
    lp, ent = out if with_entropy else (out, torch.zeros_like(out))
    w = torch.linspace(0.5, 1.5, lp.numel()).view_as(lp)
    ((lp * w).sum() + (ent * w.flip(1)).sum()).backward()
    return lp.detach(), ent.detach(), x.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_logprobs_equal_the_whole(dtype):
    """Log-probs, entropy and their gradients a chunk of the sequence at a time equal the whole
    computation within fp32 rounding (padding ids >= 90 masked, temperature, uneven last chunk)."""
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 11, 96, generator=g)).to(dtype)
    targets = torch.randint(0, 90, (3, 11), generator=g)
    ref = _logprobs_and_grads(logits, targets, None)
    assert torch.isfinite(ref[2]).all() and ref[2].abs().sum() > 0
    for chunk in (1, 4, 11):
        got = _logprobs_and_grads(logits, targets, chunk)
        for a, b in zip(ref, got):
            assert torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-6), (chunk, (a - b).abs().max())
    lp, _, grad = _logprobs_and_grads(logits, targets, 3, with_entropy=False)
    assert torch.allclose(lp, _logprobs_and_grads(logits, targets, None, with_entropy=False)[0], atol=1e-6)
    assert grad[..., 90:].abs().sum() == 0  # padding columns get no gradient


def test_chunk_size_follows_the_budget():
    from puzzle.training.vocab_parallel import LOGITS_CHUNK_BYTES, sequence_chunk

    assert sequence_chunk((1, 64, 200)) == 64  # small logits: whole
    # 8k positions x 152k vocabulary on one rank: chunks of 441 positions (256 MiB of fp32 each)
    c = sequence_chunk((1, 8191, 152064))
    assert 4 * c * 152064 <= LOGITS_CHUNK_BYTES < 4 * (c + 1) * 152064
    assert sequence_chunk((4, 8191, 152064)) == c // 4
    assert sequence_chunk((64, 10, 10 ** 7)) == 1
