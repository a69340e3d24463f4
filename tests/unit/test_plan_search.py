"""Plan search: profile data, cost model, Eq. (1), switch bytes, memory model, searches (pure CPU)."""

import itertools
import json
import math
import pathlib

import pytest

from puzzle.parallel.plan import ParallelPlan as PP, PlanError
from puzzle.plan_search import (LLAMA_SHAPES, CostModel, InfeasibleError, MemoryFitError, MemoryModel, ModelShape,
                         PPOJob, PPOWorkload, ProfileError, exhaustive_search, grouped_time, load_profile,
                         ppo_roles, save_profile, sequential_time, similarity_search, switch_bytes_max_rank,
                         switch_bytes_per_rank, time_sharing_time, validate_profile)
from puzzle.plan_search.memory_model import GiB
from puzzle.plan_search.search import _Evaluator

S = LLAMA_SHAPES
PROFILE = load_profile("a100_80gb")
# hand-sized model for switch bytes: split params per layer S = h*(h+2kv) + h*h + 3*h*f
#   = 8*24 + 64 + 3*8*16 = 640; replicated (2 norms) R = 16; embedding = head = V*h = 256; final norm 8
TINY = ModelShape(num_layers=2, hidden_size=8, ffn_hidden_size=16, num_attention_heads=2, num_query_groups=2,
                  vocab_size=32)


# ---- profile data ------------------------------------------------------------------------------
def test_bundled_profile_has_table1_shapes_and_hardware():
    assert PROFILE.device_memory_bytes == 80 * GiB and PROFILE.ranks_per_node == 8
    assert PROFILE.intra_node_bandwidth == 240e9 and PROFILE.inter_node_bandwidth == 25e9
    assert "312 TFLOP/s" in PROFILE.comment and "2.0 TB/s" in PROFILE.comment
    for name in ("350M", "7B", "13B", "33B", "70B"):
        tab = PROFILE.layer_table(S[name])
        assert tab.name == name  # served from the JSON, not the analytic fallback
        assert tab.fwd(2048, 1) > tab.fwd(2048, 8) > 0  # TP splits the layer
        assert tab.bwd(2048, 1) > 1.5 * tab.fwd(2048, 1)
    # 7B layer, 4096 tokens, T=1: 2*4096*202M flops at ~0.55 of 312 TFLOP/s ~ 9.7 ms (+launches)
    assert 0.008 < PROFILE.layer_table(S["7B"]).fwd(4096, 1) < 0.012
    # decode of a 7B layer at T=1 is HBM bound: 404 MB / 1.6 TB/s = 0.25 ms (+30 us)
    assert PROFILE.layer_table(S["7B"]).decode(1, 1) == pytest.approx(0.000283, rel=0.02)


def test_bundled_profile_is_what_its_regeneration_writes(tmp_path):
    from puzzle.plan_search.bundled_profile import regenerate_bundled
    from puzzle.plan_search.profile_data import PROFILE_DIR

    bundled = pathlib.Path(PROFILE_DIR) / "a100_80gb.json"
    copy = tmp_path / "a100_80gb.json"
    copy.write_text(bundled.read_text())
    prof = regenerate_bundled(str(copy))
    assert len(prof.layers) == 5
    assert json.loads(copy.read_text()) == json.loads(bundled.read_text())


def test_profile_validation_and_roundtrip(tmp_path):
    data = json.loads(json.dumps(PROFILE.to_json()))
    bad = json.loads(json.dumps(data))
    del bad["hardware"]["hbm_bandwidth"]
    with pytest.raises(ProfileError, match="hbm_bandwidth"):
        validate_profile(bad)
    bad = json.loads(json.dumps(data))
    bad["layers"][0]["fwd_s"]["1"][1][0] = 1.0  # x no longer increasing
    with pytest.raises(ProfileError, match=r"layers\[0\].fwd_s\[1\].*increasing"):
        validate_profile(bad)
    bad = json.loads(json.dumps(data))
    bad["layers"][0]["decode_s"]["3"] = [[1, 1.0]]
    with pytest.raises(ProfileError, match="T=3 is not a power of two"):
        validate_profile(bad)
    path = tmp_path / "p.json"
    save_profile(PROFILE, str(path))
    again = load_profile(str(path))
    assert again.layer_table(S["13B"]).fwd(3000, 2) == PROFILE.layer_table(S["13B"]).fwd(3000, 2)
    # interpolation: linear between points, proportional beyond the last one
    tab = again.layer_table(S["7B"])
    lo, hi = tab.fwd(2048, 1), tab.fwd(4096, 1)
    assert tab.fwd(3072, 1) == pytest.approx((lo + hi) / 2)
    assert tab.fwd(2 * 65536, 1) == pytest.approx(2 * tab.fwd(65536, 1))


# ---- cost model ---------------------------------------------------------------------------------
def test_more_microbatches_give_smaller_bubble_fraction():
    actor = ppo_roles(S["7B"], S["350M"])["actor"]
    fractions, totals = [], []
    for batch in (8, 16, 32, 64, 128):
        cost = CostModel(PROFILE, PPOWorkload(batch, micro_batch_size=2)).train_cost(actor, PP(4, 2, 1))
        pipe = (cost.n_micro + 4 - 1) * cost.t_stage
        fractions.append((pipe - cost.n_micro * cost.t_stage) / pipe)
        totals.append(cost.total)
        assert cost.n_micro == batch // 2 // 2
        assert fractions[-1] == pytest.approx(3 / (cost.n_micro + 3))
    assert all(a > b for a, b in zip(fractions, fractions[1:]))
    assert all(a < b for a, b in zip(totals, totals[1:]))  # more samples still take longer


def test_cost_model_sanity():
    w = PPOWorkload(128, micro_batch_size=4)
    cm, roles = CostModel(PROFILE, w), ppo_roles(S["7B"], S["7B"])
    actor = roles["actor"]
    # twice the replicas: less time per training step; forward-only is cheaper than training
    assert cm.train_cost(actor, PP(1, 8, 1)).total < cm.train_cost(actor, PP(1, 4, 1)).total
    assert cm.forward_cost(actor, PP(1, 8, 1)).total < cm.train_cost(actor, PP(1, 8, 1)).total / 2
    # decode is HBM bound: more T -> faster generation; the value head model has no LM head cost
    assert cm.generation_cost(actor, PP(1, 1, 8)).total < cm.generation_cost(actor, PP(1, 1, 2)).total
    # a TP group across nodes (T=8 starting at rank 4) pays the inter-node all-reduce
    assert cm.train_cost(actor, PP(1, 1, 8, offset=4)).total > cm.train_cost(actor, PP(1, 1, 8)).total


def test_time_sharing_is_eq1():
    w = PPOWorkload(64, micro_batch_size=2)
    cm, roles = CostModel(PROFILE, w), ppo_roles(S["7B"], S["350M"])
    a, c = cm.train_cost(roles["actor"], PP(4, 2, 1)), cm.train_cost(roles["critic"], PP(4, 2, 1))
    P, nb = 4, a.n_micro
    assert nb == c.n_micro == 16
    ts = time_sharing_time([a, c])
    assert ts == pytest.approx(nb * (a.t_stage + c.t_stage) + (P - 1) * max(a.t_stage, c.t_stage) + a.extra + c.extra)
    seq = sequential_time([a, c])
    assert seq == pytest.approx((nb + P - 1) * (a.t_stage + c.t_stage) + a.extra + c.extra)
    # the paper's theoretical speedup, Eq. (1), on the pipelined parts
    eq1 = (nb + P - 1) * (a.t_stage + c.t_stage) / (nb * (a.t_stage + c.t_stage) + (P - 1) * max(a.t_stage, c.t_stage))
    assert (seq - a.extra - c.extra) / (ts - a.extra - c.extra) == pytest.approx(eq1)
    assert eq1 > 1.0
    # different P cannot time-share: grouped_time falls back to the sequential sum
    c2 = cm.train_cost(roles["critic"], PP(2, 4, 1))
    assert grouped_time([a, c2]) == (pytest.approx(a.total + c2.total), False)
    with pytest.raises(ValueError, match="equal P"):
        time_sharing_time([a, c2])
    # the search's colocated training stage uses Eq. (1)
    ev = _Evaluator(PPOJob(8, S["7B"], S["350M"], w, PROFILE))
    L = ev.layouts[0]
    ia, ic = L.plans["A"].index(PP(4, 2, 1)), L.plans["C"].index(PP(4, 2, 1))
    assert ev.train_time(0, ia, ic) == (pytest.approx(ts), True)


def test_search_time_shares_equal_p():
    """The trainer time-shares models of one stage at equal P, whatever their (D, T) (validate_args,
    puzzle.parallel.streams): Eq. (1); unequal P, or experts split at another plan, run one model after
    the other, and so does each group of a disjoint layout."""
    from dataclasses import replace

    from puzzle.plan_search.cost_model import colocated_time, stage_time

    w = PPOWorkload(64, micro_batch_size=2)
    cm, roles = CostModel(PROFILE, w), ppo_roles(S["7B"], S["350M"])
    a, c = cm.train_cost(roles["actor"], PP(4, 2, 1)), cm.train_cost(roles["critic"], PP(4, 2, 1))
    c_dt = cm.train_cost(roles["critic"], PP(4, 1, 2))
    assert colocated_time([a, c]) == (pytest.approx(time_sharing_time([a, c])), True)
    assert colocated_time([a, c_dt]) == (pytest.approx(time_sharing_time([a, c_dt])), True)
    assert time_sharing_time([a, c_dt]) < a.total + c_dt.total
    assert stage_time([a, c_dt], "time-sharing") == pytest.approx(time_sharing_time([a, c_dt]))
    c_p2 = cm.train_cost(roles["critic"], PP(2, 4, 1))
    assert colocated_time([a, c_p2]) == (pytest.approx(a.total + c_p2.total), False)
    a_ep, c_ep = replace(a, plan=PP(4, 2, 1, E=2)), replace(c, plan=PP(4, 2, 1, E=2))
    assert colocated_time([a_ep, c_dt]) == (pytest.approx(a.total + c_dt.total), False)
    assert colocated_time([a_ep, c_ep]) == (pytest.approx(time_sharing_time([a, c])), True)
    ev = _Evaluator(PPOJob(8, S["7B"], S["350M"], w, PROFILE))
    L = ev.layouts[0]
    ia, ic = L.plans["A"].index(PP(4, 2, 1)), L.plans["C"].index(PP(4, 1, 2))
    assert ev.train_time(0, ia, ic) == (pytest.approx(time_sharing_time([a, c_dt])), True)
    # disjoint@4: actor and ref on ranks 0-3 run one after the other ('disjoint' runs each group so)
    D = next(x for x in ev.layouts if x.k == 4)
    ia, ir = D.plans["A"].index(PP(2, 2, 1)), D.plans["R"].index(PP(2, 2, 1))
    ic, iw = 0, 0
    fa, tr = D.fwd["A"][ia], D.task["R"][ir]
    assert ev.w.actor_logprobs_in_scoring
    side_c = D.fwd["C"][ic].total + D.task["W"][iw].total
    assert ev.score_time(D.li, ia, ic, ir, iw) == (pytest.approx(max(fa.total + tr.total, side_c)), False)


# ---- switch bytes -------------------------------------------------------------------------------
def test_switch_bytes_identical_plans_is_zero():
    for plan in (PP(1, 1, 1), PP(2, 1, 1), PP(1, 2, 1), PP(1, 1, 2)):
        assert switch_bytes_max_rank(TINY, plan, plan) == 0
    assert switch_bytes_max_rank(S["7B"], PP(4, 2, 1), PP(4, 2, 1)) == 0


def test_switch_bytes_pp2_to_tp2_by_hand():
    # (2,1,1): rank 0 holds layer 0 + embedding, rank 1 holds layer 1 + final norm + head.
    # (1,1,2): rank t holds half (t) of both layers' split weights, their norms, half the
    # embedding and the head, the final norm. bf16 = 2 bytes per parameter.
    # rank 0 lacks: layer 1's half (640/2) + layer 1's norms (16) + half the head (128) + final norm (8)
    # rank 1 lacks: layer 0's half (320) + layer 0's norms (16) + half the embedding (128)
    per = switch_bytes_per_rank(TINY, PP(2, 1, 1), PP(1, 1, 2))
    assert per == {0: (2 * (320 + 16 + 128 + 8), 0), 1: (2 * (320 + 16 + 128), 0)}
    assert switch_bytes_max_rank(TINY, PP(2, 1, 1), PP(1, 1, 2)) == 944
    # the value-head model has no vocabulary head: rank 0 lacks 320 + 16 + value head 8 + final norm 8
    assert switch_bytes_per_rank(TINY, PP(2, 1, 1), PP(1, 1, 2), lm_head=False)[0] == (2 * (320 + 16 + 8 + 8), 0)
    # TP -> DP: each rank lacks the other TP half of both layers, embedding and head, but already
    # holds every (replicated) norm: 2 * 320 + 128 + 128 = 896 parameters
    assert switch_bytes_per_rank(TINY, PP(1, 1, 2), PP(1, 2, 1)) == {0: (2 * 896, 0), 1: (2 * 896, 0)}
    # pure data parallelism holds everything: nothing is missing when moving to TP
    assert switch_bytes_max_rank(TINY, PP(1, 2, 1), PP(1, 1, 2)) == 0
    # ranks outside the source plan lack their whole shard: (1,1,1) -> (1,2,1): rank 1 needs all
    full = 2 * TINY.param_count()
    assert switch_bytes_per_rank(TINY, PP(1, 1, 1), PP(1, 2, 1)) == {0: (0, 0), 1: (full, 0)}
    # one rank per node: the missing piece lives on the other node -> inter-node bytes
    assert switch_bytes_per_rank(TINY, PP(2, 1, 1), PP(1, 1, 2), ranks_per_node=1)[1] == (0, 2 * (320 + 16 + 128))


def test_switch_bytes_match_routing_table_lower_bound():
    # the routing table of puzzle.switch computes the same lower bound from megatron's parameter
    # list; the vocabulary (1024) needs no padding, so the two must agree byte for byte
    from puzzle.models.param_layout import gpt_param_specs
    from puzzle.switch import build_routing_table
    shape = ModelShape(8, 64, 96, 8, 4, 1024)
    pairs = [(PP(4, 2, 1), PP(1, 2, 4)), (PP(8, 1, 1), PP(2, 1, 4)), (PP(2, 2, 2), PP(1, 8, 1)),
             (PP(1, 2, 4), PP(8, 1, 1)), (PP(2, 4, 1), PP(4, 1, 2))]
    for head in ("lm", "value"):
        specs = gpt_param_specs(8, 64, 96, 8, 4, 1024, head=head)
        assert sum(s.numel for s in specs) == shape.param_count(lm_head=head == "lm")
        for src, dst in pairs:
            table = build_routing_table(specs, src, dst, dtype_bytes=2)
            mine = switch_bytes_per_rank(shape, src, dst, lm_head=head == "lm")
            assert {r: sum(v) for r, v in mine.items()} == {r: table.bytes_lacking(r) for r in range(8)}
    with pytest.raises(PlanError, match="num_query_groups=4 is not divisible by T=8"):
        switch_bytes_max_rank(shape, PP(1, 1, 8), PP(8, 1, 1))


def test_switch_time_uses_link_bandwidth():
    w = PPOWorkload(64)
    actor = ppo_roles(S["7B"], S["350M"])["actor"]
    cm = CostModel(PROFILE, w)
    # (8,2,1) on 16 ranks: stage p on ranks 2p, 2p+1; (1,2,8): replica d on node d -> each needs 7/8
    # of its shard from the other stages, half of which live on the other node
    nbytes, t = cm.switch(actor, PP(8, 2, 1), PP(1, 2, 8))
    per = switch_bytes_per_rank(S["7B"], PP(8, 2, 1), PP(1, 2, 8), ranks_per_node=8)
    assert nbytes == max(a + b for a, b in per.values()) == switch_bytes_max_rank(S["7B"], PP(8, 2, 1), PP(1, 2, 8))
    assert t == pytest.approx(max(a / 240e9 + b / 25e9 for a, b in per.values()))
    assert all(b > 0 for a, b in per.values())


# ---- memory model -------------------------------------------------------------------------------
def test_memory_model_rejects_too_big_model_with_numbers():
    w = PPOWorkload(128, micro_batch_size=4)
    mm, actor = MemoryModel(PROFILE, w), ppo_roles(S["33B"], S["350M"])["actor"]
    phi = S["33B"].param_count()
    with pytest.raises(MemoryFitError) as ei:
        mm.check_model(actor, PP(1, 8, 1), "training")
    msg = str(ei.value)
    assert msg.startswith("actor training plan (1,8,1): rank 0")
    assert f"actor weights {2 * phi / GiB:.1f}" in msg
    assert f"actor grads {4 * phi / GiB:.1f}" in msg
    assert f"actor optimizer {12 * phi / 8 / GiB:.1f}" in msg
    assert "> 80.0 GiB" in msg
    # the same model fits when sharded enough; a frozen copy has no grads/optimizer
    assert mm.check_model(actor, PP(4, 1, 8), "training").fits
    ref = ppo_roles(S["33B"], S["350M"])["ref"]
    assert [k for k, _ in mm.static_items(ref, PP(1, 8, 1), 0)] == ["ref weights"]


def test_memory_components():
    w = PPOWorkload(64, micro_batch_size=2)
    mm, actor = MemoryModel(PROFILE, w), ppo_roles(S["7B"], S["350M"])["actor"]
    # 1F1B: the first stage keeps P micro-batches in flight, the last one
    first = dict(mm.train_items(actor, PP(4, 1, 1), 0))["actor activations"]
    last = dict(mm.train_items(actor, PP(4, 1, 1), 3))["actor activations"]
    assert first == pytest.approx(4 * last)
    # distributed optimizer: Adam states divide by D
    opt = lambda D: dict(mm.static_items(actor, PP(1, D, 1), 0))["actor optimizer"]
    assert opt(1) == pytest.approx(4 * opt(4))
    # the shadow generation model is only there when the generation plan differs
    with_shadow = dict(mm.generation_items(actor, PP(1, 1, 8), 0, shadow=True))
    assert with_shadow["actor shadow weights"] == pytest.approx(2 * (S["7B"].param_count() - 0) / 8, rel=0.01)
    assert "actor shadow weights" not in dict(mm.generation_items(actor, PP(1, 1, 8), 0, shadow=False))


# ---- searches -------------------------------------------------------------------------------------
@pytest.mark.parametrize("world,actor,critic,batch", [(4, "350M", "350M", 64), (4, "7B", "350M", 32),
                                                      (8, "7B", "350M", 128), (8, "7B", "7B", 64)])
def test_similarity_equals_exhaustive_small_worlds(world, actor, critic, batch):
    job = PPOJob(world, S[actor], S[critic], PPOWorkload(batch, micro_batch_size=4), PROFILE)
    sim, ex = similarity_search(job), exhaustive_search(job)
    assert sim.total_time == pytest.approx(ex.total_time, rel=1e-9)
    assert max(sim.memory_bytes) <= PROFILE.device_memory_bytes
    assert sum(sim.stage_times.values()) == pytest.approx(sim.total_time)
    assert sim.plans_evaluated > 0 and ex.plans_evaluated > 0


def test_exhaustive_branch_and_bound_is_exact():
    # brute force over the whole 4-rank space without pruning
    job = PPOJob(4, S["7B"], S["350M"], PPOWorkload(32, micro_batch_size=4), PROFILE)
    ev = _Evaluator(job)
    best = math.inf
    for L in ev.layouts:
        if L.ok:
            for idx in itertools.product(*(range(len(L.plans[v])) for v in ("A", "G", "C", "R", "W"))):
                t, ov = ev.evaluate((L.li,) + idx)
                if ov <= 0:
                    best = min(best, t)
    assert ev.n_evals == ev.space_size() > 1000
    assert exhaustive_search(job).total_time == pytest.approx(best, rel=1e-12)


def test_search_result_fields_and_placements():
    job = PPOJob(16, S["13B"], S["350M"], PPOWorkload(256, micro_batch_size=4), PROFILE)
    res = similarity_search(job)
    assert set(res.plans) == {"actor", "critic", "ref", "reward"}
    assert res.plans["actor"]["training"] == res.plans["actor"]["scoring"]
    assert set(res.placements) == {"generation", "scoring", "training"}
    assert all(p in ("single", "sequential", "disjoint", "time-sharing") for p in res.placements.values())
    assert len(res.memory_bytes) == 16
    sw = switch_bytes_max_rank(S["13B"], res.plans["actor"]["training"], res.plans["actor"]["generation"])
    assert res.switch_bytes == sw
    # the per-rank vectors of the search agree with the itemised report used in error messages
    mm = MemoryModel(PROFILE, job.workload)
    roles = ppo_roles(S["13B"], S["350M"])
    shadow = res.plans["actor"]["generation"] != res.plans["actor"]["training"]
    for r in (0, 7, 15):
        assert mm.rank_report(r, res.plans, roles, shadow).total == pytest.approx(res.memory_bytes[r])
    d = res.to_dict()
    assert json.loads(json.dumps(d))["plans"]["actor"]["generation"].startswith("(")


def test_infeasible_error_lists_closest_plans():
    job = PPOJob(8, S["33B"], S["7B"], PPOWorkload(128, micro_batch_size=4), PROFILE)
    with pytest.raises(InfeasibleError) as ei:
        exhaustive_search(job)
    msg = str(ei.value)
    assert msg.startswith("no feasible plan for actor 34.67B / critic 6.61B on 8 ranks")
    assert "closest configurations:" in msg
    lines = [ln for ln in msg.splitlines() if ln.startswith("  - ")]
    assert len(lines) == 5
    assert all("actor train (" in ln and "GiB > 80.0 GiB" in ln and "actor optimizer" in ln for ln in lines)
    with pytest.raises(InfeasibleError, match="closest configurations"):
        similarity_search(job)


def test_infeasible_error_when_world_has_no_layout():
    odd = ModelShape(num_layers=5, hidden_size=66, ffn_hidden_size=99, num_attention_heads=3, num_query_groups=3,
                     vocab_size=100)
    with pytest.raises(InfeasibleError) as ei:
        similarity_search(PPOJob(3, odd, odd, PPOWorkload(2), PROFILE, disjoint_fractions=()))
    msg = str(ei.value)
    assert msg.startswith("no feasible plan for actor 0.2M / critic 0.2M on 3 ranks")
    assert "layout colocated: actor training on 3 ranks has no valid (P,D,T): (1,3,1): D=3 > 2 samples" in msg
    assert "closest configurations" not in msg
    # a disjoint layout fits: the actor generates on its own training ranks (the switch stays there)
    res = similarity_search(PPOJob(3, odd, odd, PPOWorkload(2), PROFILE))
    assert res.layout.startswith("disjoint")
    assert res.plans["actor"]["generation"].ranks == res.plans["actor"]["training"].ranks
    with pytest.raises(InfeasibleError) as ei:
        exhaustive_search(PPOJob(2, odd, odd, PPOWorkload(1), PROFILE, disjoint_fractions=()))
    msg = str(ei.value)
    assert ("actor generation on 2 ranks has no valid (P,D,T): (1,2,1): D=2 > 1 samples per generation batch; "
            "(1,1,2): num_attention_heads=3 is not divisible by T=2; num_query_groups=3 is not divisible by T=2; "
            "ffn_hidden_size=99 is not divisible by T=2; (2,1,1): num_layers=5 is not divisible by P=2") in msg
