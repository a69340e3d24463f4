"""--moe-grouped-gemm's grouped products (puzzle/models/grouped_gemm.py) against one product per
expert, values and gradients, empty experts included (the flag's checks before allocation are in
tests/unit/test_moe.py)."""

import pytest
import torch

from puzzle.models.grouped_gemm import grouped_linear


def _per_expert(x, counts, weights):
    return torch.cat([part @ w.t() for part, w in zip(x.split(counts), weights)])


@pytest.mark.parametrize("counts", [[3, 0, 9, 4], [0, 0, 16, 0], [5, 6, 2, 3]])
def test_grouped_linear_is_one_product_per_expert(counts):
    g = torch.Generator().manual_seed(sum(counts) + counts[0])
    x = torch.randn(sum(counts), 8, generator=g)
    weights = [torch.randn(24, 8, generator=g) for _ in counts]
    up = torch.randn(sum(counts), 24, generator=g)
    got_x, ref_x = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    got_w = [w.clone().requires_grad_(True) for w in weights]
    ref_w = [w.clone().requires_grad_(True) for w in weights]
    offs = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    got = grouped_linear(got_x, offs, got_w)
    ref = _per_expert(ref_x, counts, ref_w)
    assert torch.allclose(got, ref, rtol=1e-6, atol=1e-6)
    (got * up).sum().backward()
    (ref * up).sum().backward()
    assert torch.allclose(got_x.grad, ref_x.grad, rtol=1e-6, atol=1e-5)
    for n, a, b in zip(counts, got_w, ref_w):  # each expert's gradient reaches its own parameter
        assert a.grad is not None and torch.allclose(a.grad, b.grad, rtol=1e-6, atol=1e-5)
        assert (n == 0) == (not a.grad.any())
