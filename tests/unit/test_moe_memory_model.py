"""Mixture-of-experts terms of the memory model, the cost model and the plan search (pure CPU)."""

import dataclasses
import io

import pytest

from puzzle.parallel.plan import ParallelPlan as PP
from puzzle.plan_search import (CostModel, InfeasibleError, MemoryModel, ModelRole, ModelShape, PPOJob, PPOWorkload,
                                exhaustive_search, load_profile, similarity_search)
from puzzle.plan_search import experts
from puzzle.plan_search.cost_model import expert_params_on_rank, params_on_stage
from puzzle.plan_search.search import candidate_plans

PROFILE = load_profile("a100_80gb")
W = PPOWorkload(rollout_batch_size=64, prompt_len=256, gen_len=256, micro_batch_size=2)
DENSE = ModelShape(num_layers=8, hidden_size=512, ffn_hidden_size=1024, num_attention_heads=8, num_query_groups=4,
                   vocab_size=1024)
#: one expert of the dense MLP's width, always chosen: the dense model plus a 1-expert router
ONE_EXPERT = dataclasses.replace(DENSE, num_experts=1, moe_router_topk=1, moe_ffn_hidden_size=1024)
MOE = dataclasses.replace(DENSE, num_experts=16, moe_router_topk=2, moe_ffn_hidden_size=256)
#: Qwen3-30B-A3B (HF config: 48 layers, hidden 2048, 32 heads / 4 KV groups of 128, 128 experts of 768, top-8)
QWEN3_30B = ModelShape(num_layers=48, hidden_size=2048, ffn_hidden_size=6144, num_attention_heads=32,
                       num_query_groups=4, vocab_size=151936, kv_channels=128, num_experts=128,
                       moe_router_topk=8, moe_ffn_hidden_size=768)


def _role(shape, trainable=True):
    return ModelRole("actor", shape, trainable, True)


def _items(mem, role, plan, kind="static"):
    return dict(mem.items(kind, role, plan, 0))


def test_qwen3_30b_a3b_parameter_counts():
    """30.5B parameters, 3.3B active (the model card's figures)."""
    assert QWEN3_30B.param_count() == pytest.approx(30.53e9, rel=2e-3)
    assert QWEN3_30B.active_param_count() == pytest.approx(3.35e9, rel=1e-2)
    assert QWEN3_30B.compute_shape.ffn_hidden_size == 8 * 768 and not QWEN3_30B.compute_shape.is_moe


def test_one_always_chosen_expert_is_the_dense_model():
    dense, one = _role(DENSE), _role(ONE_EXPERT)
    router = DENSE.num_layers * DENSE.hidden_size
    assert ONE_EXPERT.param_count() == DENSE.param_count() + router
    assert ONE_EXPERT.compute_shape == DENSE
    plan = PP(1, 4, 1)
    assert (params_on_stage(one, 1, 1, 0) + expert_params_on_rank(one, plan)
            == pytest.approx(params_on_stage(dense, 1, 1, 0) + router))
    mem = MemoryModel(PROFILE, W)
    d, m = _items(mem, dense, plan), _items(mem, one, plan)
    assert m["actor weights"] + m["actor expert weights"] == pytest.approx(d["actor weights"] + 2 * router)
    # no all-to-all at E = 1: training and scoring cost the dense model's, up to the router's bytes
    cm = CostModel(PROFILE, W)
    assert cm._moe_comm(one, 4096, plan) == 0.0
    assert cm.train_cost(one, plan).total == pytest.approx(cm.train_cost(dense, plan).total, rel=1e-3)
    assert cm.forward_cost(one, plan).total == pytest.approx(cm.forward_cost(dense, plan).total, rel=1e-6)
    # a dense model has no expert items at all
    assert set(d) == {"actor weights", "actor grads", "actor optimizer"}


def test_expert_state_scales_with_E():
    mem, role = MemoryModel(PROFILE, W), _role(MOE)
    per_E = {E: _items(mem, role, PP(1, 16, 1, E=E)) for E in (1, 2, 4, 16)}
    for E, items in per_E.items():
        assert items["actor expert weights"] == pytest.approx(per_E[1]["actor expert weights"] / E)
        assert items["actor expert grads"] == pytest.approx(per_E[1]["actor expert grads"] / E)
        # optimizer states: split over E, sharded over EDP = 16 / E: the same bytes per rank
        assert items["actor expert optimizer"] == pytest.approx(per_E[1]["actor expert optimizer"])
        # the dense part keeps its (P, D, T) split
        assert items["actor weights"] == per_E[1]["actor weights"]
    # ETP splits each expert like E splits the experts
    assert _items(mem, role, PP(1, 8, 2, E=2, ETP=2))["actor expert weights"] == pytest.approx(
        per_E[4]["actor expert weights"])


def test_moe_activations_hold_the_routed_tokens():
    mem = MemoryModel(PROFILE, W)
    dense_mlp = 6.0 * DENSE.ffn_hidden_size
    moe = experts.moe_activation_bytes_per_token(MOE, 1, 1, 1)
    k, f, h = MOE.moe_router_topk, MOE.moe_ffn_hidden_size, MOE.hidden_size
    assert moe == 6.0 * k * f + 4.0 * k * h + 8.0 * MOE.num_experts
    assert mem.act_per_token_layer(_role(MOE), 1) - mem.act_per_token_layer(_role(DENSE), 1) == pytest.approx(
        moe - dense_mlp)
    # training at T = 2 splits the layer's tokens over T: a rank routes half of them (router
    # included); with ETP = T the pairs of the ETP group are gathered, each rank holding its share
    # of the expert's width for all of them
    assert experts.moe_activation_bytes_per_token(MOE, 2, 1, 1) == pytest.approx(moe / 2)
    split_etp = experts.moe_activation_bytes_per_token(MOE, 2, 1, 2)
    assert split_etp == pytest.approx(6.0 * k * f / 2 + 4.0 * k * h + 8.0 * 16 / 2)
    # forward-only passes do not split: every TP rank routes all of its tokens (ETP = 2 gathers
    # the two ranks' copies)
    assert experts.moe_activation_bytes_per_token(MOE, 2, 1, 1, split=False) == moe
    assert experts.moe_activation_bytes_per_token(MOE, 2, 1, 2, split=False) == pytest.approx(
        moe + 4.0 * k * h)
    assert mem.act_per_token_layer(_role(MOE), 2, split=False) > mem.act_per_token_layer(_role(MOE), 2)
    # the KV cache is the attention's
    kv = mem.kv_bytes_per_sequence
    assert kv(_role(MOE), PP(1, 4, 1, E=4)) == kv(_role(DENSE), PP(1, 4, 1))


def test_all_to_all_bytes_and_time():
    assert experts.dispatch_bytes(MOE, 4096, 1, 1, 1) == 0.0
    assert experts.dispatch_bytes(MOE, 4096, 4, 1, 1) == 4096 * 512 * 2 * 2 * 3 / 4
    cm, role = CostModel(PROFILE, W), _role(MOE)
    intra, inter = cm._moe_comm(role, 4096, PP(1, 8, 1, E=8)), cm._moe_comm(role, 4096, PP(1, 16, 1, E=16))
    assert 0.0 < intra < inter  # E = 16 spans two nodes of 8
    one = experts.dispatch_seconds(PROFILE, MOE, 4096, 8, 1, 1, False)
    assert intra == pytest.approx(2 * one)  # dispatch + combine per MoE layer forward
    # training pays 4 all-to-alls per MoE layer (2 forward, 2 backward) over E = 1
    t1, t8 = cm.train_cost(role, PP(1, 8, 1)), cm.train_cost(role, PP(1, 8, 1, E=8))
    tokens = W.micro_batch_size * W.seq_len
    extra = MOE.num_layers * 2 * cm._moe_comm(role, tokens, PP(1, 8, 1, E=8))
    assert t8.t_stage - t1.t_stage == pytest.approx(extra, rel=1e-9)


def test_decode_reads_the_experts_touched():
    n, k = 128, 8
    assert experts.expected_experts_touched(n, k, 1) == pytest.approx(k)
    assert experts.expected_experts_touched(n, k, 10 ** 4) == pytest.approx(n)
    touched = [experts.expected_experts_touched(n, k, t) for t in (1, 4, 16, 64)]
    assert touched == sorted(touched) and touched[-1] < n
    assert experts.decode_extra_expert_bytes(QWEN3_30B, 1, 1, 1, 1) == pytest.approx(0.0, abs=1e-6)
    big = experts.decode_extra_expert_bytes(QWEN3_30B, 64, 1, 1, 1)
    assert big == pytest.approx((experts.expected_experts_touched(n, k, 64) - k) * 3 * 2048 * 768 * 2)
    cm = CostModel(PROFILE, dataclasses.replace(W, rollout_batch_size=512))
    role = _role(QWEN3_30B)
    # a larger batch touches more experts: a decode step of the MoE layer costs more than the dense
    # layer of the active width
    dense = cm.generation_cost(_role(QWEN3_30B.compute_shape), PP(1, 8, 1))
    assert cm.generation_cost(role, PP(1, 8, 1)).t_stage > dense.t_stage


def test_candidate_plans_search_E():
    plans, _ = candidate_plans(MOE, 8, 0, W, "training", 8)
    # MoE trains at T > 1 (megatron_patches.moe_tensor_parallel_without_sp), ETP = T or 1
    assert {(q.T, q.ETP) for q in plans} == {(1, 1), (2, 2), (2, 1), (4, 4), (4, 1)}  # T <= 4 query groups
    assert {q.E for q in plans if q.P == 1} == {1, 2, 4, 8}
    assert all(q.D * q.T % (q.E * q.ETP) == 0 and MOE.num_experts % q.E == 0 for q in plans)
    scoring, _ = candidate_plans(MOE, 8, 0, W, "scoring", 8)
    assert {q.ETP for q in scoring if q.T == 2} == {1, 2}
    generation, bad = candidate_plans(MOE, 8, 0, W, "generation", 8)
    assert all(q.D % max(1, q.E * q.ETP // q.T) == 0 for q in generation)
    dense = candidate_plans(DENSE, 8, 0, W, "training", 8)[0]
    assert dense and all(q.E == 1 and q.ETP == q.T for q in dense)  # a dense model's plans are (P, D, T)


def test_search_splits_experts_that_do_not_fit_whole():
    """Qwen3-30B-A3B GRPO on 16 x 80 GB: E = 1 holds 30B parameters' state per rank; the search
    splits the experts. On 8 ranks only training at T > 1 fits (T splits the attention's and the
    embeddings' state; ETP = 1 keeps the experts over E = 8); 4 ranks hold no plan."""
    w = PPOWorkload(rollout_batch_size=64, prompt_len=256, gen_len=512, micro_batch_size=1)
    job = PPOJob(world_size=16, actor=QWEN3_30B, critic=QWEN3_30B, workload=w, roles=("actor", "ref"))
    res = similarity_search(job)
    actor = res.plans["actor"]
    assert actor["training"].E > 1 and actor["generation"].E > 1
    assert res.layout == "colocated"  # no critic: a disjoint layout would leave ranks without a trainable model
    assert res.peak_memory_bytes <= PROFILE.device_memory_bytes
    eight = dataclasses.replace(job, world_size=8)
    sim, ex = similarity_search(eight), exhaustive_search(eight)
    assert sim.plans["actor"]["training"].T > 1 and ex.plans["actor"]["training"].T > 1
    assert sim.peak_memory_bytes <= PROFILE.device_memory_bytes
    assert ex.total_time <= sim.total_time <= 1.02 * ex.total_time  # 0.5 % apart
    # the exhaustive search counts the offload round trip as the objective does: never above
    offload = dataclasses.replace(eight, workload=dataclasses.replace(w, offload_during_inference=True))
    assert exhaustive_search(offload).total_time <= similarity_search(offload).total_time * (1 + 1e-12)
    with pytest.raises(InfeasibleError, match="actor expert optimizer"):
        similarity_search(dataclasses.replace(job, world_size=4))


def test_plan_document_carries_E_to_the_run():
    from puzzle.arguments import parse_args, validate_args
    from puzzle.plan_layouts import layouts_as_flags, read_plan_document
    from puzzle.plan_search.memory_model import fmt_plan

    plan = PP(1, 4, 1, E=2)
    assert PP.parse(fmt_plan(plan)) == plan and fmt_plan(plan) == "(1,4,1,E=2)"
    doc = {"plans": {"actor": {"training": "(1,4,1,E=2)", "generation": "(1,4,1,E=2)"},
                     "ref": {"scoring": "(1,2,2,E=2,ETP=1)"}}}
    layouts = read_plan_document(doc)
    flags = layouts_as_flags(layouts)
    assert flags[flags.index("--actor-expert-model-parallel-size") + 1] == "2"
    cfg = validate_args(parse_args(_TINY_MOE + ["--kl-coef", "0.1"]), 4, 259, check_paths=False, layouts=layouts)
    assert (cfg.roles["actor"].plan, cfg.roles["actor"].gen_plan) == (plan, plan)
    assert cfg.roles["ref"].plan == PP(1, 2, 2, E=2, ETP=1)


_TINY_MOE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
             "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
             "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--micro-batch-size", "2",
             "--rollout-batch-size", "8", "--max-new-tokens", "16", "--num-experts", "4",
             "--moe-ffn-hidden-size", "32", "--advantage-estimator", "grpo", "--n-samples-per-prompt", "2",
             "--reward-fn", "puzzle.reward_functions.builtin:lowercase_fraction", "--transformer-impl", "local"]


def test_dry_run_of_a_moe_run():
    from puzzle.arguments import parse_args, validate_args
    from puzzle.plan_search.command import memory_estimate, print_dry_run, search

    cfg = validate_args(parse_args(_TINY_MOE + ["--expert-model-parallel-size", "2"]), 4, 259, check_paths=False)
    out = io.StringIO()
    assert print_dry_run(cfg, PROFILE, out)
    text = out.getvalue()
    assert "actor   (1,4,1,E=2), generation (1,4,1,E=2)" in text
    assert "actor experts: 4 per MoE layer in 2 of 2 layers, top-2" in text and "E=2, ETP=1" in text
    labels = {label for label, _ in memory_estimate(cfg, PROFILE)[0].items}
    assert {"actor expert weights", "actor expert grads", "actor expert optimizer", "ref expert weights"} <= labels
    result, _ = search(cfg, PROFILE)
    assert result.plans["actor"]["generation"] == result.plans["actor"]["training"]


def test_qwen3_30b_a3b_example_fits_16_gpus_of_80_gb():
    """examples/run_grpo_qwen3_30b_a3b.sh's flags, checked in this process as its --dry-run does."""
    from tests.harness import REPO, script_arrays

    from puzzle.arguments import build_parser, config_for_planning
    from puzzle.plan_search.command import memory_estimate, search, stage_estimate

    arrays = script_arrays(REPO / "examples" / "run_grpo_qwen3_30b_a3b.sh")
    flags = [f.replace("$GPUS_PER_NODE", "8") for name, fl in arrays.items()
             if name not in ("DISTRIBUTED_ARGS", "ALL_ARGS") for f in fl]
    cfg = config_for_planning(build_parser(prog="x", raise_errors=True).parse_args(flags + ["--world-size", "16"]))
    actor = cfg.roles["actor"]
    assert (actor.plan, actor.gen_plan) == (PP(1, 16, 1, E=8, ETP=1),) * 2
    assert actor.arch.num_experts == 128 and actor.arch.kv_channels == 128 and cfg.ppo.max_new_tokens + 512 == 4096
    reports = memory_estimate(cfg, PROFILE)
    assert all(r.fits for r in reports) and len(reports) == 16
    # the search trains at (2,8,1,E=2) and generates at the script's (1,16,1,E=8), the reference at
    # (2,8,1,E=8): 0.17 % faster than the script's layout, at 77.4 GiB of 80 against 66.6
    result, _ = search(cfg, PROFILE)
    actor = result.plans["actor"]
    assert (actor["training"], actor["generation"]) == (PP(2, 8, 1, E=2, ETP=1), PP(1, 16, 1, E=8, ETP=1))
    assert result.plans["ref"]["scoring"] == PP(2, 8, 1, E=8, ETP=1) and not result.levers
    script = sum(stage_estimate(cfg, PROFILE).values())
    assert result.total_time < script < 1.005 * result.total_time
    assert max(r.total for r in reports) < result.peak_memory_bytes <= PROFILE.device_memory_bytes


def test_switch_bytes_of_experts_by_hand():
    """8 ranks, 4 per node: E = 8 -> E = 4 doubles each rank's experts. Rank 0 keeps [0, 2) and
    takes [2, 4) from rank 1 (its node); rank 2 needs [8, 12), held by ranks 4 and 5 (the other
    node). E = 4 -> E = 8 halves them: rank 0 holds its half already."""
    from puzzle.plan_search.cost_model import switch_bytes_per_rank

    whole = MOE.num_layers * MOE.num_experts * experts.expert_params(MOE) * 2
    down = experts.switch_bytes(MOE, PP(1, 8, 1, E=8), PP(1, 8, 1, E=4), 4)
    assert down[0] == (whole / 8, 0.0) and down[2] == (0.0, whole / 4) and down[7] == (whole / 8, 0.0)
    up = experts.switch_bytes(MOE, PP(1, 8, 1, E=4), PP(1, 8, 1, E=8), 4)
    assert up[0] == (0.0, 0.0) and up[1] == (whole / 8, 0.0)
    assert all(v == (0.0, 0.0) for v in experts.switch_bytes(MOE, PP(1, 8, 1, E=8), PP(1, 8, 1, E=8), 4).values())
    # the dense part's lower bound is unchanged by the experts: E moves only expert bytes
    same_dense = switch_bytes_per_rank(MOE, PP(1, 8, 1, E=8), PP(1, 8, 1, E=4), ranks_per_node=4)
    assert same_dense[2] == (0, round(whole / 4))
    assert CostModel(PROFILE, W).switch(_role(MOE), PP(1, 8, 1, E=8), PP(1, 8, 1, E=4))[0] == round(whole / 4)


def test_training_at_T_splits_the_moe_layers_tokens():
    """Training at T > 1 runs each MoE layer on the rank's 1/T of the tokens (as sequence
    parallelism would): its dispatcher moves that share, an all-gather over T replaces the MLP's
    all-reduce, and the routers' partial gradients are all-reduced over T. Forward-only passes
    compute all tokens' experts on every TP rank."""
    tokens, k, h = 4096, MOE.moe_router_topk, MOE.hidden_size
    a2a = tokens * h * k * 2 * 3 / 4  # E = 4, ETP = 1, whole micro-batch
    assert experts.dispatch_bytes(MOE, tokens, 4, 1, 2) == a2a  # forward-only: every TP rank routes all
    assert experts.dispatch_bytes(MOE, tokens, 4, 1, 2, split=True) == a2a / 2
    # ETP = 2 all-gathers the received pairs over the expert's two ranks
    etp2 = experts.dispatch_bytes(MOE, tokens, 4, 2, 2, split=True)
    assert etp2 == pytest.approx(tokens / 2 * h * k * 2 * (3 / 4 + 1))
    gather = dataclasses.replace(MOE, moe_dispatcher="allgather")
    assert experts.dispatch_bytes(gather, tokens, 2, 2, 2, split=True) == tokens / 2 * h * 2 * 3
    cm, role = CostModel(PROFILE, W), _role(MOE)
    plan = PP(1, 4, 2, E=4, ETP=1)
    ar = PROFILE.allreduce_time(tokens * h * 2, 2, False)
    assert cm._tp_comm(role, tokens, plan, False) == pytest.approx(ar)  # the attention's only
    ag = (tokens / 2) * h * 2 / PROFILE.bandwidth(False) + PROFILE.latency(False)
    assert cm._tp_comm(role, tokens, plan, False, split=True) == pytest.approx(ar + ag)
    assert cm._tp_comm(_role(DENSE), tokens, plan, False) == pytest.approx(2 * ar)
    # the training step pays the split layer's collectives, the router gradients' all-reduce
    # over T, and no duplicated expert work
    tr = cm.train_cost(role, plan)
    mb = W.micro_batch_size * W.seq_len
    tab = PROFILE.layer_table(MOE.compute_shape)
    per_layer = cm._tp_comm(role, mb, plan, False, True) + cm._moe_comm(role, mb, plan, split=True)
    assert tr.t_stage == pytest.approx(MOE.num_layers * (tab.fwd(mb, 2) + tab.bwd(mb, 2) + 2 * per_layer)
                                       + 3 * cm._head_fwd(role, mb, 2))
    router = MOE.num_layers * MOE.num_experts * h
    assert cm._router_grad_sum(role, plan, False) == PROFILE.allreduce_time(4.0 * router, 2, False) > 0
    # forward-only at T = 2: the experts' FLOPs beyond the T-split share, every token's activations
    fwd = cm.forward_cost(role, plan)
    extra = PROFILE.gemm_time(experts.unsplit_expert_flops(MOE, mb, 2))
    assert extra > 0 and fwd.t_stage == pytest.approx(
        MOE.num_layers * (tab.fwd(mb, 2) + extra + cm._tp_comm(role, mb, plan, False) + cm._moe_comm(role, mb, plan))
        + cm._head_fwd(role, mb, 2))
    assert experts.unsplit_expert_flops(MOE, mb, 1) == 0.0 == experts.unsplit_expert_flops(DENSE, mb, 2)


#: a MoE layer wide enough for the experts to matter: 8 experts of 14336, top-2, 16 layers
WIDE_MOE = ModelShape(num_layers=16, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                      num_query_groups=8, vocab_size=32000, num_experts=8, moe_router_topk=2,
                      moe_ffn_hidden_size=14336)


@pytest.mark.parametrize("job", [
    PPOJob(8, MOE, DENSE, PPOWorkload(64, micro_batch_size=2), PROFILE),
    PPOJob(8, WIDE_MOE, WIDE_MOE, PPOWorkload(64, micro_batch_size=2), PROFILE, roles=("actor", "ref")),
], ids=["moe-actor-dense-critic@8", "wide-moe-grpo@8"])
def test_moe_search_matches_exhaustive(job):
    """The similarity search reaches the exhaustive optimum over MoE plans (E, ETP, training at
    T > 1, generation at its own layout); every rank holds part of a trainable model."""
    sim, ex = similarity_search(job), exhaustive_search(job)
    assert sim.total_time == pytest.approx(ex.total_time, rel=1e-9)
    assert sim.peak_memory_bytes <= PROFILE.device_memory_bytes
    trained = {r for m, st in sim.plans.items() if "training" in st for r in st["training"].ranks}
    assert trained == set(range(job.world_size))


def test_moe_actor_generates_at_a_layout_of_its_own():
    """The wide MoE actor trains with its experts over the 8 ranks at T = 1 and generates at T = 2
    (a decode step reads half the attention's weights per rank); every rank already holds its
    generation shard (the experts stay where they are, T = 2 keeps half of what T = 1 holds), so
    the switch moves nothing, and generating at the training layout would be slower."""
    job = PPOJob(8, WIDE_MOE, DENSE, PPOWorkload(64, micro_batch_size=2), PROFILE)
    res = similarity_search(job)
    train, gen = res.plans["actor"]["training"], res.plans["actor"]["generation"]
    assert gen != train and train.E == gen.E == 8 and (train.T, gen.T) == (1, 2)
    cm, role = CostModel(PROFILE, job.workload), _role(WIDE_MOE)
    assert res.switch_bytes == cm.switch(role, train, gen)[0] == 0
    assert cm.switch(role, gen, train)[0] > 0  # back to training: the other half of the attention
    assert res.stage_times["generation"] == cm.generation_cost(role, gen).total < cm.generation_cost(role, train).total


def test_no_disjoint_layout_without_a_critic():
    """A disjoint layout's second group holds the critic and the reward model; without a critic
    its ranks would train nothing (runs refuse such a plan), so the search offers none."""
    from puzzle.plan_search.search import _Evaluator

    grpo = PPOJob(8, MOE, MOE, PPOWorkload(64, micro_batch_size=2), PROFILE, roles=("actor", "ref", "reward"))
    assert [L.name for L in _Evaluator(grpo).layouts] == ["colocated"]
    ppo = dataclasses.replace(grpo, roles=("actor", "critic", "ref", "reward"))
    assert [L.name for L in _Evaluator(ppo).layouts] == ["colocated", "disjoint@2", "disjoint@4", "disjoint@6"]


def test_descent_moves_between_etp_layouts():
    """The descent's moves reach ETP = 1 plans: an exchange into T > 1 keeps ETP = 1 where ETP = T
    has no plan (E * T > D * T), back to T = 1 lands on the one plan there, and ETP switches between
    T and 1 at the same E or at the same E * ETP."""
    from puzzle.plan_search.search import _etp_moves, _exchanged, _plan_key

    plans = candidate_plans(MOE, 8, 0, W, "training", 8)[0]
    where = {_plan_key(q): i for i, q in enumerate(plans)}
    at = lambda q: where[_plan_key(q)]
    # (1,8,1,E=8) with D -> T: (1,4,2,E=8,ETP=2) needs 16 ranks per stage, so ETP = 1
    assert _exchanged([1, 4, 2, 8, 0], where) == at(PP(1, 4, 2, E=8, ETP=1))
    assert _exchanged([1, 8, 1, 8, 1], where) == at(PP(1, 8, 1, E=8))
    assert _exchanged([1, 4, 2, 2, 0], where) == at(PP(1, 4, 2, E=2, ETP=2))  # ETP follows T where it can
    assert _etp_moves(PP(1, 4, 2, E=2, ETP=2), where) == [at(PP(1, 4, 2, E=2, ETP=1)), at(PP(1, 4, 2, E=4, ETP=1))]
    assert _etp_moves(PP(1, 4, 2, E=4, ETP=1), where) == [at(PP(1, 4, 2, E=4, ETP=2)), at(PP(1, 4, 2, E=2, ETP=2))]
    assert _etp_moves(PP(1, 8, 1, E=4), where) == [-1, -1]


def test_cuda_graph_generation_is_searched_as_it_runs():
    """Under --cuda-graph-generation the actor generates at P = 1 and a MoE actor with every expert
    whole on each rank (E = 1, ETP = 1): the only generation layouts such a run accepts."""
    from puzzle.plan_search.cost_model import plan_problems

    graphs = dataclasses.replace(W, cuda_graphs=True)
    assert plan_problems(MOE, PP(1, 8, 1, E=8), W, "generation", 8) == []
    assert plan_problems(MOE, PP(1, 8, 1, E=8), graphs, "generation", 8) == [
        "E=8, ETP=1: CUDA-graph generation of a MoE model needs every expert whole on each rank (E=1, ETP=1)"]
    assert plan_problems(MOE, PP(2, 4, 1, E=1), graphs, "generation", 8) == ["P=2: CUDA-graph generation needs P=1"]
    assert plan_problems(MOE, PP(2, 4, 1, E=4), graphs, "training", 8) == []
    gen = similarity_search(PPOJob(8, MOE, DENSE, graphs, PROFILE)).plans["actor"]["generation"]
    assert (gen.P, gen.E, gen.ETP) == (1, 1, 1)
    # priced as the static step runs: one row per rank reads the top-2 of 8 experts eagerly (as
    # much as the dense layer of the active width), every expert when graphed
    one_row = dataclasses.replace(W, rollout_batch_size=8)
    for workload, low, high in ((one_row, 1.0, 1.0), (dataclasses.replace(one_row, cuda_graphs=True), 3.0, 4.0)):
        cm = CostModel(PROFILE, workload)
        moe, active = (cm.generation_cost(_role(s), PP(1, 8, 1)).total for s in (WIDE_MOE, WIDE_MOE.compute_shape))
        assert low * active <= moe * (1 + 1e-12) and moe <= high * active * (1 + 1e-12)
