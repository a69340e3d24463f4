"""The routing executor's per-rank plan: cached, messages agreed by both ends, direct messages
contiguous, shapes checked before anything moves (pure CPU, no process group)."""

import pytest
import torch

import puzzle.switch.routing_executor as rex
from puzzle.models.param_layout import gpt_param_specs
from puzzle.parallel.plan import ParallelPlan
from puzzle.switch import RoutingExecutor, build_routing_table
from puzzle.switch.routing import local_params

SHAPE = dict(num_layers=4, hidden_size=32, ffn_hidden_size=48, num_attention_heads=8, num_query_groups=4,
             padded_vocab_size=64)
PAIRS = [("4,1,1", "2,1,2"), ("2,1,2", "1,1,4"), ("1,1,4", "1,2,2"), ("2,2,1", "1,2,2"), ("1,2,2", "2,2,1")]


def _params(specs, plan, rank, fill=0.0):
    out = {}
    for local, spec in local_params(specs, plan, rank):
        shape = [n // plan.T if d == spec.split_dim else n for d, n in enumerate(spec.global_shape)]
        out[local] = torch.full(shape, fill)
    return out


def _executors(a, b, monkeypatch, direct_min_bytes):
    monkeypatch.setattr(rex, "DIRECT_MIN_BYTES", direct_min_bytes)
    specs = gpt_param_specs(**SHAPE)
    src, dst = ParallelPlan.parse(a), ParallelPlan.parse(b)
    table = build_routing_table(specs, src, dst)
    return table, [RoutingExecutor(table, _params(specs, src, r), _params(specs, dst, r), rank=r, num_segments=2)
                   for r in range(src.size)]


@pytest.mark.parametrize("direct_min_bytes", [1, 1 << 40])
@pytest.mark.parametrize("a,b", PAIRS)
def test_both_ends_agree_on_every_message(a, b, direct_min_bytes, monkeypatch):
    table, exs = _executors(a, b, monkeypatch, direct_min_bytes)
    sent = sorted((r, bk.peer, bk.tag, bk.numel, bk.direct) for r, ex in enumerate(exs)
                  for seg in ex.plan.send_buckets for bk in seg)
    received = sorted((bk.peer, r, bk.tag, bk.numel, bk.direct) for r, ex in enumerate(exs)
                      for bk in ex.plan.recv_buckets)
    assert sent == received and sent
    assert any(m[4] for m in sent) == (direct_min_bytes == 1)
    # every byte a rank lacks arrives, none more
    for r, ex in enumerate(exs):
        esize = 4
        assert sum(bk.numel for bk in ex.plan.recv_buckets) * esize == table.bytes_lacking(r)
        for bk in ex.plan.recv_buckets:  # a direct message lands in place: its view is contiguous
            if bk.direct:
                assert len(bk.pieces) == 1 and ex._view(bk.pieces[0], ex.dst_params).is_contiguous()
        for seg in ex.plan.send_buckets:
            for bk in seg:
                if bk.direct:
                    assert ex._view(bk.pieces[0], ex.src_params).is_contiguous()


def test_plan_is_derived_once_per_table(monkeypatch):
    table, exs = _executors("2,1,2", "1,1,4", monkeypatch, rex.DIRECT_MIN_BYTES)
    again = RoutingExecutor(table, exs[1].src_params, exs[1].dst_params, rank=1, num_segments=2)
    assert again.plan is exs[1].plan
    assert RoutingExecutor(table, exs[1].src_params, exs[1].dst_params, rank=1).plan is not exs[1].plan


def test_wrong_shape_is_one_clear_error_before_anything_moves(monkeypatch):
    table, exs = _executors("2,1,2", "1,1,4", monkeypatch, rex.DIRECT_MIN_BYTES)
    dst = dict(exs[0].dst_params)
    name = next(iter(dst))
    dst[name] = torch.zeros(1)
    with pytest.raises(ValueError, match=f"rank 0: destination parameter '{name}' has shape"):
        RoutingExecutor(table, exs[0].src_params, dst, rank=0)
    del dst[name]
    with pytest.raises(KeyError, match="is missing"):
        RoutingExecutor(table, exs[0].src_params, dst, rank=0)


def test_local_only_switch_is_bitwise(monkeypatch):
    """One rank, another layout of the same rank (identity): local copies only, no messages."""
    specs = gpt_param_specs(**SHAPE)
    plan = ParallelPlan.parse("1,1,1")
    table = build_routing_table(specs, plan, plan)
    src = {k: torch.randn(v.shape) for k, v in _params(specs, plan, 0).items()}
    dst = _params(specs, plan, 0, fill=float("nan"))
    stats = RoutingExecutor(table, src, dst, rank=0, num_segments=3).finish()
    assert stats.messages_sent == stats.messages_received == 0
    assert all(torch.equal(src[k], dst[k]) for k in src)
