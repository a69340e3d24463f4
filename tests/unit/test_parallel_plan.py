import pytest

from puzzle.config import ModelArch
from puzzle.parallel.plan import ParallelPlan, PlanError


def test_rank_order_t_fastest_then_d_then_p():
    plan = ParallelPlan(P=2, D=2, T=2)
    assert [plan.coords(r) for r in range(8)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert all(plan.rank(*plan.coords(r)) == r for r in range(8))


def test_groups():
    plan = ParallelPlan(2, 1, 2)
    assert plan.tp_groups() == [[0, 1], [2, 3]]
    assert plan.pp_groups() == [[0, 2], [1, 3]]
    assert plan.dp_groups() == [[0], [1], [2], [3]]
    assert plan.mp_groups() == [[0, 1, 2, 3]]
    assert plan.embedding_groups() == [[0, 2], [1, 3]]
    off = ParallelPlan(1, 2, 1, offset=2)
    assert off.ranks == [2, 3] and off.dp_groups() == [[2, 3]]


@pytest.mark.parametrize("kw, msg", [
    (dict(P=0), "ParallelPlan.P must be a positive integer"),
    (dict(T=-1), "ParallelPlan.T"),
    (dict(D=1.5), "ParallelPlan.D"),
])
def test_bad_degrees(kw, msg):
    with pytest.raises(PlanError, match=msg):
        ParallelPlan(**kw)


def test_world_and_model_checks():
    with pytest.raises(PlanError, match=r"needs ranks 0..7 .* world has 4"):
        ParallelPlan(2, 2, 2).check_world(4)
    arch = ModelArch.llama(num_layers=3, hidden_size=64, num_attention_heads=4, num_query_groups=2)
    with pytest.raises(PlanError) as e:
        ParallelPlan(2, 1, 4).check_model(num_layers=3, num_attention_heads=4, num_query_groups=2,
                                          ffn_hidden_size=256, hidden_size=64,
                                          padded_vocab_size=arch.padded_vocab_size, what="actor")
    assert "actor cannot use plan" in str(e.value)
    assert "num_layers=3 is not divisible by P=2" in str(e.value)
    assert "num_query_groups=2 is not divisible by T=4" in str(e.value)


def test_parse():
    assert ParallelPlan.parse("2,1,2") == ParallelPlan(2, 1, 2)
    assert ParallelPlan.parse("(1,2,2)@4") == ParallelPlan(1, 2, 2, offset=4)
    with pytest.raises(PlanError, match="cannot parse"):
        ParallelPlan.parse("2,1")


def test_vocab_padding_is_layout_independent():
    arch = ModelArch.llama(vocab_size=200, make_vocab_size_divisible_by=64)
    assert arch.padded_vocab_size == 256


def test_bad_arch():
    with pytest.raises(ValueError, match="num_attention_heads=6 is not divisible by num_query_groups=4"):
        ModelArch.llama(hidden_size=96, num_attention_heads=6, num_query_groups=4)
