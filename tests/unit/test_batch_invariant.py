"""--batch-invariant-mode's pieces (puzzle/models/batch_invariant.py): every per-row result has the
same bits at any number of rows and in a decode step as in a full forward, under 1 and 2 threads;
the flag's refusals. The whole runs are tests/distributed/test_batch_invariant.py."""

import pytest
import torch
import torch.nn.functional as F

from puzzle.arguments import ArgumentError, parse_args, validate_args
from puzzle.models import batch_invariant as bi
from puzzle.engine.vocab_parallel import vocab_parallel_logprobs
from tests.unit.test_arguments import BASE


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    saved = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(saved)


def _rows_alone(fn, x):
    """fn of each row of x on its own, stacked."""
    return torch.stack([fn(x[i:i + 1])[0] for i in range(x.shape[0])])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k, n", [(33, 50), (256, 1), (32, 9), (256, 2000)])
def test_products_do_not_depend_on_the_number_of_rows(threads, dtype, k, n):
    torch.manual_seed(0)
    w, x = torch.randn(n, k, dtype=dtype), torch.randn(48, k, dtype=dtype)
    alone = _rows_alone(lambda r: bi.tiled_matmul(r, w.t()), x)
    for m, offset in ((2, 0), (5, 7), (17, 3), (41, 7)):
        assert torch.equal(bi.tiled_matmul(x[offset:offset + m], w.t()), alone[offset:offset + m]), (m, offset)
    x3, b = x[:40].view(8, 5, k), torch.randn(n, dtype=dtype)
    with bi.batch_invariant_mode():  # megatron's and puzzle's calls of a weight's product
        assert torch.equal(torch.matmul(x3, w.t()), alone[:40].view(8, 5, n))
        assert torch.equal(x3 @ w.t(), alone[:40].view(8, 5, n))
        assert torch.equal(F.linear(x3, w, b), alone[:40].view(8, 5, n) + b)
        assert torch.equal(torch.addmm(b, x[:40], w.t()), alone[:40] + b)
        assert torch.equal(torch.mm(x[:3], w.t()), alone[:3])
        batched = torch.randn(2, k, 3, dtype=dtype)  # a batched right operand: torch's own product
        assert torch.equal(torch.matmul(x3[:2], batched), torch.bmm(x3[:2], batched))
    assert not bi.active()


def test_grouped_product_in_the_mode():
    torch.manual_seed(1)
    x, w = torch.randn(11, 16), torch.randn(3, 16, 8)
    offs = torch.tensor([4, 4, 11], dtype=torch.int32)  # the second group is empty
    with bi.batch_invariant_mode():
        out = torch._grouped_mm(x, w, offs=offs)
    assert torch.equal(out[:4], bi.tiled_matmul(x[:4], w[0]))
    assert torch.equal(out[4:], bi.tiled_matmul(x[4:], w[2]))
    assert torch.allclose(out[4:], x[4:] @ w[2], atol=1e-5)


@pytest.mark.parametrize("dtype, d", [(torch.float32, 16), (torch.bfloat16, 16), (torch.float32, 8)])
def test_decode_attention_equals_the_full_forward(threads, dtype, d):
    """Each position's decode step (its cache row holding other tokens after it, at several cache
    widths) against the causal forward of 3 sequences, lengths across key blocks; grouped queries
    (head dim 8: the value products are 9 columns wide, widened to MIN_COLUMNS)."""
    torch.manual_seed(2)
    h, g, width = 4, 2, 80
    for s in (5, bi.KEY_BLOCK + 1, 2 * bi.KEY_BLOCK + 5):
        q, k, v = (torch.randn(s, 3, heads, d, dtype=dtype) for heads in (h, g, g))
        full = bi.causal_attention(q, k, v, 0.25)  # [s, 3, h * d]
        ref = F.scaled_dot_product_attention(q.permute(1, 2, 0, 3).float(), *(
            t.permute(1, 2, 0, 3).float().repeat_interleave(h // g, 1) for t in (k, v)), is_causal=True, scale=0.25)
        assert torch.allclose(full.float(), ref.permute(2, 0, 1, 3).reshape(s, 3, h * d), atol=2e-2 if
                              dtype == torch.bfloat16 else 1e-5)
        kc, vc = torch.randn(3, g, width, d, dtype=dtype), torch.randn(3, g, width, d, dtype=dtype)
        kc[:, :, :s], vc[:, :, :s] = k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)
        for p in range(0, s, 3):
            keys = min(width, p + 1 + (7 * p) % 23)  # the step's key length: its cache's longest row
            out = bi.decode_attention(q[p:p + 1], kc[:, :, :keys], vc[:, :, :keys], torch.full((3,), p), 0.25)
            assert torch.equal(out[0], full[p]), (s, p)
        assert torch.equal(bi.causal_attention(q[:, 1:2], k[:, 1:2], v[:, 1:2], 0.25)[:, 0], full[:, 1])


def test_norms_and_elementwise_functions_per_row(threads):
    torch.manual_seed(3)
    x, w, b = torch.randn(20, 2048), torch.randn(2048), torch.randn(2048)  # > 32768 values: threads share them
    with bi.batch_invariant_mode():
        for fn in (lambda t: F.rms_norm(t, (2048,), w, 1e-5), lambda t: F.layer_norm(t, (2048,), w, b, 1e-5),
                   F.silu, torch.sigmoid, torch.exp, lambda t: F.gelu(t, approximate="tanh")):
            out = fn(x)
            assert torch.equal(out, _rows_alone(fn, x))
            assert torch.equal(out[3:19], fn(x[3:19]))  # another offset in the tensor and in a thread's share
        rms = F.rms_norm(x, (2048,), w, 1e-5)
        sums = bi.row_sum(x[:7])
    assert torch.allclose(rms, F.rms_norm(x, (2048,), w, 1e-5), rtol=1e-5, atol=1e-5)
    assert torch.equal(sums, _rows_alone(bi.row_sum, x[:7])) and torch.allclose(sums, x[:7].sum(-1), atol=1e-3)


def test_vocabulary_log_probs_per_row(threads):
    """Generation's [n, 1, V] against scoring's [1, T, V], and a row alone."""
    torch.manual_seed(4)
    logits, targets = torch.randn(40, 384) * 3, torch.randint(0, 259, (40,))
    with bi.batch_invariant_mode():
        packed = vocab_parallel_logprobs(logits.view(1, 40, 384), targets.view(1, 40), None, 259)[0]
        rows = vocab_parallel_logprobs(logits.view(40, 1, 384), targets.view(40, 1), None, 259)[:, 0]
        alone = torch.stack([vocab_parallel_logprobs(logits[i].view(1, 1, 384), targets[i].view(1, 1), None, 259)[0, 0]
                             for i in range(40)])
    assert torch.equal(packed, rows) and torch.equal(packed, alone)
    assert torch.allclose(packed, vocab_parallel_logprobs(logits.view(1, 40, 384), targets.view(1, 40), None, 259)[0],
                          atol=1e-5)


def test_the_flag_is_refused_where_parity_cannot_hold(monkeypatch):
    from puzzle.parallel import device

    flag = ["--batch-invariant-mode"]
    cfg = validate_args(parse_args(BASE + flag + ["--tensor-model-parallel-size", "2"]), 4, 259)
    assert cfg.ppo.batch_invariant_mode and not validate_args(parse_args(BASE), 4, 259).ppo.batch_invariant_mode
    with pytest.raises(ArgumentError, match=r"^--batch-invariant-mode: the actor generates at T=1 and is scored at "
                                            r"T=2: .* --actor-gen-tensor-model-parallel-size 2$"):
        validate_args(parse_args(BASE + flag + ["--tensor-model-parallel-size", "2",
                                                "--actor-gen-tensor-model-parallel-size", "1"]), 4, 259)
    with pytest.raises(ArgumentError, match=r"^--batch-invariant-mode: the actor's experts are split over ETP=4 ranks"):
        validate_args(parse_args(BASE + flag + ["--num-experts", "4", "--tensor-model-parallel-size", "4"]), 4, 259)
    moe = validate_args(parse_args(BASE + flag + ["--num-experts", "4", "--tensor-model-parallel-size", "4",
                                                  "--expert-tensor-parallel-size", "2"]), 4, 259)
    assert moe.roles["actor"].plan.ETP == 2
    with pytest.raises(ArgumentError, match="^--batch-invariant-mode: not with --cuda-graph-generation"):
        validate_args(parse_args(BASE + flag + ["--cuda-graph-generation"]), 1, 259)
    monkeypatch.setattr(device, "accelerator_available", lambda: True)
    with pytest.raises(ArgumentError, match="^--batch-invariant-mode: runs on CPU only: on CUDA"):
        validate_args(parse_args(BASE + flag), 1, 259)
