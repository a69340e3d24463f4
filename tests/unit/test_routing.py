"""Routing tables for plan switches: simulated bitwise, minimal, balanced (pure CPU, fast)."""

from collections import defaultdict

import numpy as np
import pytest

from puzzle.parallel.plan import ParallelPlan, PlanError
from puzzle.models.param_layout import (global_name, gpt_param_specs, local_name, params_on_stage,
                                        shard_slices, stage_of_layer)
from puzzle.switch import box_to_slices, build_routing_table

# GQA (8 heads, 4 query groups), SwiGLU, untied embeddings: splits up to T=4.
GQA = dict(num_layers=4, hidden_size=32, ffn_hidden_size=48, num_attention_heads=8, num_query_groups=4,
           padded_vocab_size=64)
# GQA (16 heads, 8 query groups): splits up to T=8.
GQA16 = {**GQA, "num_attention_heads": 16, "num_query_groups": 8}


def _local_shape(spec, T):
    """Shape of one TP rank's shard of ``spec``."""
    return tuple(n // T if d == spec.split_dim else n for d, n in enumerate(spec.global_shape))


def plan(text):
    return ParallelPlan.parse(text)


def simulate(specs, table, src, dst, lps_src=None, lps_dst=None, seed=0):
    """Build src shards from random global tensors, apply the ops, check every dst shard bitwise."""
    rng = np.random.default_rng(seed)
    glob = {s.name: rng.standard_normal(s.global_shape).astype(np.float32) for s in specs}

    def shards(pl, lps, fill):
        out = defaultdict(dict)
        for p in range(pl.P):
            for local, s in params_on_stage(specs, p, pl.P, lps):
                for d in range(pl.D):
                    for t in range(pl.T):
                        if fill:
                            pieces = [glob[s.name][box_to_slices(b)] for b in shard_slices(s, pl.T, t)]
                            arr = np.concatenate(pieces, axis=s.split_dim or 0)
                        else:
                            arr = np.full(_local_shape(s, pl.T), np.nan, np.float32)
                        out[pl.rank(p, d, t)][local] = (s, arr)
        return out

    have, want = shards(src, lps_src, True), shards(dst, lps_dst, False)
    for op in table.ops:
        s_spec, s_arr = have[op.src_rank][op.src_local]
        d_spec, d_arr = want[op.dst_rank][op.dst_local]
        assert s_spec.name == d_spec.name == op.param
        assert np.array_equal(s_arr[box_to_slices(op.src_box)], glob[op.param][box_to_slices(op.global_box)])
        d_arr[box_to_slices(op.dst_box)] = s_arr[box_to_slices(op.src_box)]
    n_checked = 0
    for p in range(dst.P):
        for local, s in params_on_stage(specs, p, dst.P, lps_dst):
            for d in range(dst.D):
                for t in range(dst.T):
                    r = dst.rank(p, d, t)
                    expect = np.concatenate([glob[s.name][box_to_slices(b)] for b in shard_slices(s, dst.T, t)],
                                            axis=s.split_dim or 0)
                    got = want[r][local][1]
                    assert got.tobytes() == expect.tobytes(), (r, local)
                    n_checked += 1
    assert n_checked == sum(len(v) for v in want.values())


def check_table(specs, src, dst, **kw):
    table = build_routing_table(specs, src, dst, **kw)
    simulate(specs, table, src, dst, kw.get("layers_per_stage_src"), kw.get("layers_per_stage_dst"))
    for r in dst.ranks:
        assert table.bytes_received(r) == table.bytes_lacking(r), r
    assert sum(table.bytes_sent(r) for r in src.ranks) == table.total_bytes()
    # one op per (param, src, dst), two only for SwiGLU fc1 (gate and up halves)
    per = defaultdict(int)
    for op in table.ops:
        per[(op.param, op.src_rank, op.dst_rank)] += 1
    for (name, _, _), n in per.items():
        assert n <= (2 if "linear_fc1" in name else 1), name
    assert build_routing_table(specs, src, dst, **kw).ops == table.ops  # deterministic
    return table


PAIRS_4 = [("4,1,1", "2,1,2"), ("2,1,2", "1,1,4"), ("1,2,2", "1,1,4"), ("2,2,1", "1,2,2")]
PAIRS_8 = [("2,2,2", "1,2,4"), ("4,2,1", "2,1,4"), ("1,8,1", "2,1,4"), ("2,1,4", "1,4,2"), ("4,2,1", "1,1,8"),
           ("2,1,4", "1,1,8")]


@pytest.mark.parametrize("a,b", PAIRS_4 + PAIRS_8)
@pytest.mark.parametrize("direction", ["fwd", "back"])
def test_switch_bitwise_and_minimal(a, b, direction):
    src, dst = (plan(a), plan(b)) if direction == "fwd" else (plan(b), plan(a))
    specs = gpt_param_specs(**(GQA16 if max(src.T, dst.T) > 4 else GQA))
    table = check_table(specs, src, dst)
    for r in dst.ranks:  # (d) well below the full all-gather baseline
        assert table.bytes_received(r) <= table.allgather_bytes(r)
    allgather = [table.allgather_bytes(r) for r in dst.ranks]
    if dst.P * dst.T > 1:  # (a destination replicating the full model needs the all-gather volume)
        assert max(table.bytes_received(r) for r in dst.ranks) <= 0.75 * max(allgather)
        assert table.total_bytes() <= 0.6 * sum(allgather)


@pytest.mark.parametrize("kw", [
    dict(untie_embeddings=False),
    dict(add_bias_linear=True, normalization="LayerNorm", swiglu=False),
    dict(add_bias_linear=True),  # SwiGLU fc1 bias: 1-D [gate; up]
    dict(head="value"),
    dict(head="score", untie_embeddings=False, add_qkv_bias=True),
    dict(position_embedding_type="learned_absolute", max_sequence_length=16, untie_embeddings=False),
])
@pytest.mark.parametrize("a,b", [("4,1,1", "2,1,2"), ("1,2,2", "2,1,2"), ("1,1,4", "4,1,1")])
def test_model_variants(kw, a, b):
    specs = gpt_param_specs(**GQA, **kw)
    check_table(specs, plan(a), plan(b))
    check_table(specs, plan(b), plan(a))


def test_single_rank_and_identity_is_free():
    specs = gpt_param_specs(**GQA)
    t = check_table(specs, plan("1,1,1"), plan("1,1,1"))
    assert t.total_bytes() == 0 and all(o.is_local for o in t.ops)
    assert len(t.ops) == len(specs)
    specs = gpt_param_specs(**GQA16)
    for p in ["4,1,1", "2,1,2", "1,2,2", "2,2,2", "1,1,8"]:  # (c)
        t = check_table(specs, plan(p), plan(p))
        assert t.total_bytes() == 0 and all(t.bytes_lacking(r) == 0 for r in plan(p).ranks)


def test_offset_plans():
    specs = gpt_param_specs(**GQA)
    t = check_table(specs, ParallelPlan(2, 1, 2, offset=4), ParallelPlan(1, 1, 4, offset=4))
    assert {o.src_rank for o in t.ops} | {o.dst_rank for o in t.ops} <= set(range(4, 8))


def test_destination_moved_to_another_pool():
    """A table moved to the same layout on other ranks (the overlap's generation pool): every op
    still delivers the same box, now across ranks, and each moved rank lacks its whole shard."""
    specs = gpt_param_specs(**GQA)
    src, dst = plan("1,2,1"), plan("1,1,2")
    base = check_table(specs, src, dst)
    moved = base.with_destination_moved(2, ParallelPlan(1, 1, 2, offset=2))
    assert [(o.param, o.src_rank, o.dst_rank - 2, o.global_box) for o in moved.ops] == [
        (o.param, o.src_rank, o.dst_rank, o.global_box) for o in base.ops]
    assert {o.dst_rank for o in moved.ops} == {2, 3} and not any(o.is_local for o in moved.ops)
    assert moved.total_bytes() > base.total_bytes()
    whole = [base.bytes_lacking(r) + sum(o.nbytes for o in base.ops if o.dst_rank == r and o.is_local) for r in (0, 1)]
    assert [moved.bytes_lacking(r) for r in (2, 3)] == whole == [moved.bytes_received(r) for r in (2, 3)]
    assert moved.bytes_lacking(0) == 0
    with pytest.raises(ValueError, match="is not the layout of"):
        base.with_destination_moved(2, ParallelPlan(1, 2, 1, offset=2))


def test_sender_balancing_among_replicas():  # (e)
    specs = gpt_param_specs(**GQA)
    src, dst = plan("1,2,2"), plan("1,1,4")
    t = check_table(specs, src, dst)
    sent = [t.bytes_sent(r) for r in src.ranks]
    assert all(s > 0 for s in sent), sent  # both replicas (all four ranks) send
    # ranks 0 and 2 both hold what rank 1 lacks; 1 and 3 what rank 2 lacks: split about evenly
    assert abs(sent[0] - sent[2]) <= 0.1 * (sent[0] + sent[2])
    assert abs(sent[1] - sent[3]) <= 0.1 * (sent[1] + sent[3])
    assert t.bytes_received(0) == t.bytes_received(3) == 0


def test_prefers_same_node():
    specs = gpt_param_specs(**GQA)
    t = check_table(specs, plan("1,2,2"), plan("1,1,4"), ranks_per_node=2)
    for o in t.ops:
        assert o.src_rank // 2 == o.dst_rank // 2, o
    # on one node the choice is by load again
    t = check_table(specs, plan("1,2,2"), plan("1,1,4"), ranks_per_node=4)
    assert all(t.bytes_sent(r) > 0 for r in range(4))


def test_generalises_algorithm_1():
    """Paper Algorithm 1 (D fixed, P shrinks by f_P, T grows by f_T = f_P): source rank
    (p, d, t) broadcasts to destination ranks (p // f_P, d, t * f_T + i), i < f_P. For D = 1 the
    (src, dst) pairs of our TP-split parameters (local copies included) are exactly those."""
    specs = gpt_param_specs(**GQA16)
    for a, b in [("4,1,1", "2,1,2"), ("2,1,2", "1,1,4"), ("4,1,1", "1,1,4"), ("4,1,2", "1,1,8")]:
        src, dst = plan(a), plan(b)
        f_p, f_t = src.P // dst.P, dst.T // src.T
        assert f_p == f_t
        expect = set()
        for r in src.ranks:
            p, d, t = src.coords(r)
            expect |= {(r, dst.rank(p // f_p, d, t * f_t + i)) for i in range(f_p)}
        table = check_table(specs, src, dst)
        kinds = {s.name: s.kind for s in specs}
        pairs = {(o.src_rank, o.dst_rank) for o in table.ops if kinds[o.param] != "replicated"}
        assert pairs == expect, (a, b)


def test_uneven_layers_per_stage():
    specs = gpt_param_specs(**{**GQA, "num_layers": 5})
    check_table(specs, plan("2,1,2"), plan("4,1,1"), layers_per_stage_src=[2, 3], layers_per_stage_dst=[1, 1, 2, 1])
    check_table(specs, plan("4,1,1"), plan("1,1,4"), layers_per_stage_src=[2, 1, 1, 1])
    check_table(specs, plan("2,2,1"), plan("2,1,2"), layers_per_stage_src=[4, 1], layers_per_stage_dst=[1, 4])
    with pytest.raises(PlanError, match="num_layers=5 is not divisible by P=2"):
        build_routing_table(specs, plan("2,1,2"), plan("4,1,1"), layers_per_stage_dst=[1, 1, 2, 1])
    with pytest.raises(PlanError, match="summing to num_layers=5"):
        build_routing_table(specs, plan("2,1,2"), plan("1,1,4"), layers_per_stage_src=[2, 2])


def test_plan_errors():  # (f)
    specs = gpt_param_specs(**GQA)
    with pytest.raises(PlanError, match="different world sizes"):
        build_routing_table(specs, plan("2,1,2"), plan("1,1,8"))
    with pytest.raises(PlanError, match="different ranks"):
        build_routing_table(specs, ParallelPlan(1, 1, 4, offset=4), plan("1,1,4"))
    with pytest.raises(PlanError, match=r"num_query_groups=2 is not divisible by T=4 of destination plan"):
        build_routing_table(gpt_param_specs(**{**GQA, "num_query_groups": 2}), plan("4,1,1"), plan("1,1,4"))
    with pytest.raises(PlanError, match=r"num_layers=4 is not divisible by P=3"):
        build_routing_table(specs, plan("3,1,1"), plan("1,3,1"))
    with pytest.raises(PlanError, match=r"ffn_hidden_size=48 is not divisible by T=32"):
        build_routing_table(gpt_param_specs(**{**GQA, "num_attention_heads": 32, "num_query_groups": 32,
                                                "hidden_size": 64}), plan("1,1,32"), plan("32,1,1"))


# ---- param_layout ------------------------------------------------------------------------------
def test_specs_names_shapes_kinds():
    specs = {s.name: s for s in gpt_param_specs(**GQA)}
    assert specs["embedding.word_embeddings.weight"].global_shape == (64, 32)
    assert specs["decoder.layers.3.self_attention.linear_qkv.weight"].global_shape == ((8 + 2 * 4) * 4, 32)
    assert specs["decoder.layers.3.self_attention.linear_qkv.weight"].kind == "qkv"
    assert specs["decoder.layers.0.self_attention.linear_proj.weight"].kind == "row"
    assert specs["decoder.layers.0.mlp.linear_fc1.weight"].global_shape == (96, 32)
    assert specs["decoder.layers.0.mlp.linear_fc2.weight"].global_shape == (32, 48)
    assert specs["output_layer.weight"].kind == "vocab"
    assert "decoder.final_layernorm.weight" in specs and "decoder.layers.0.input_layernorm.bias" not in specs
    assert len(specs) == 1 + 4 * 6 + 2
    value = {s.name: s for s in gpt_param_specs(**GQA, head="value")}
    assert "output_layer.weight" not in value and value["value_head.weight"].global_shape == (1, 32)


def test_shard_slices():
    specs = {s.name: s for s in gpt_param_specs(**GQA)}
    fc1 = specs["decoder.layers.0.mlp.linear_fc1.weight"]  # [gate 48; up 48]
    assert shard_slices(fc1, 4, 1) == [((12, 24), (0, 32)), ((60, 72), (0, 32))]
    assert shard_slices(specs["decoder.layers.0.mlp.linear_fc2.weight"], 4, 3) == [((0, 32), (36, 48))]
    assert shard_slices(specs["decoder.layers.0.self_attention.linear_qkv.weight"], 2, 1) == [((32, 64), (0, 32))]
    assert shard_slices(specs["decoder.layers.0.input_layernorm.weight"], 4, 2) == [((0, 32),)]


def test_local_global_names():
    lps = [1, 3]
    assert stage_of_layer(0, lps) == 0 and stage_of_layer(3, lps) == 1
    assert local_name("decoder.layers.2.mlp.linear_fc1.weight", 1, lps) == "decoder.layers.1.mlp.linear_fc1.weight"
    assert global_name("decoder.layers.1.mlp.linear_fc1.weight", 1, lps) == "decoder.layers.2.mlp.linear_fc1.weight"
    assert local_name("output_layer.weight", 1, lps) == "output_layer.weight"
    with pytest.raises(ValueError):
        local_name("decoder.layers.2.mlp.linear_fc1.weight", 0, lps)
    specs = gpt_param_specs(**GQA, untie_embeddings=False)
    last = [n for n, _ in params_on_stage(specs, 1, 2)]
    assert last[0] == "decoder.layers.0.input_layernorm.weight" and last[-1] == "output_layer.weight"
    assert [n for n, _ in params_on_stage(specs, 0, 1)][-1] == "decoder.final_layernorm.weight"
