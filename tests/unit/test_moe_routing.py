"""Routing tables between layouts of a mixture-of-experts model with different E (and P, D, T,
ETP): simulated bitwise against an independent description of who holds which expert, the bytes
moved equal to each rank's lower bound (pure CPU, fast)."""

from collections import defaultdict

import numpy as np
import pytest

from puzzle.models.param_layout import (expert_local_name, gpt_param_specs, params_on_stage,
                                        shard_slices)
from puzzle.parallel.plan import ParallelPlan as Plan, PlanError
from puzzle.switch import box_to_slices, build_routing_table
from puzzle.switch.routing import local_params

NUM_EXPERTS = 4
# 4 layers, layer 1 dense (Qwen3-MoE's mlp_only_layers), GQA 8 heads / 4 groups, SwiGLU experts
MOE = dict(num_layers=4, hidden_size=32, ffn_hidden_size=48, num_attention_heads=8, num_query_groups=4,
           padded_vocab_size=64, num_experts=NUM_EXPERTS, moe_ffn_hidden_size=16,
           moe_layers=[True, False, True, True])


def _holds(plan, rank):
    """{local name: (spec, TP ways, TP index)} of what ``rank`` holds, written from the layout's
    definition (megatron: rank ep holds experts [ep*n, (ep+1)*n) as local_experts.0..n-1)."""
    specs = gpt_param_specs(**MOE)
    p, _, ep, etp = plan.expert_coords(rank)
    _, _, t = plan.coords(rank)
    n = NUM_EXPERTS // plan.E
    out = {}
    for local, spec in params_on_stage(specs, p, plan.P):
        if spec.expert is None:
            out[local] = (spec, plan.T, t)
        elif ep * n <= spec.expert < (ep + 1) * n:
            out[expert_local_name(local, spec.expert - ep * n)] = (spec, plan.ETP, etp)
    return out


def _shard(glob, spec, ways, index):
    return np.concatenate([glob[spec.name][box_to_slices(b)] for b in shard_slices(spec, ways, index)],
                          axis=spec.split_dim or 0)


def _simulate(src, dst):
    """Run the table on shards cut from random global tensors; every destination shard must be
    the destination layout's slice bitwise. Returns the table."""
    specs = gpt_param_specs(**MOE)
    table = build_routing_table(specs, src, dst)
    rng = np.random.default_rng(0)
    glob = {s.name: rng.standard_normal(s.global_shape).astype(np.float32) for s in specs}
    have = {r: {k: _shard(glob, *v) for k, v in _holds(src, r).items()} for r in src.ranks}
    want = {r: {k: np.full_like(_shard(glob, *v), np.nan) for k, v in _holds(dst, r).items()} for r in dst.ranks}
    for op in table.ops:
        got = have[op.src_rank][op.src_local][box_to_slices(op.src_box)]
        assert np.array_equal(got, glob[op.param][box_to_slices(op.global_box)]), op
        want[op.dst_rank][op.dst_local][box_to_slices(op.dst_box)] = got
    for r in dst.ranks:
        for local, v in _holds(dst, r).items():
            assert want[r][local].tobytes() == _shard(glob, *v).tobytes(), (r, local)
        assert table.bytes_received(r) == table.bytes_lacking(r), r
        assert sorted(name for name, _ in local_params(specs, dst, r)) == sorted(_holds(dst, r)), r
    return table


PAIRS = [
    (Plan(1, 2, 1, E=2), Plan(1, 2, 1)),           # only E changes
    (Plan(1, 2, 1, E=2), Plan(1, 1, 2)),           # train (1,2,1,E=2) -> gen (1,1,2,E=1)
    (Plan(1, 4, 1, E=4), Plan(2, 2, 1, E=2)),
    (Plan(1, 4, 1, E=2), Plan(1, 2, 2, E=2)),      # experts split by ETP = T = 2
    (Plan(1, 4, 1, E=4), Plan(1, 2, 2, E=2, ETP=1)),
    (Plan(2, 2, 1, E=2), Plan(1, 1, 4, E=4, ETP=1)),
]


@pytest.mark.parametrize("src,dst", PAIRS + [(b, a) for a, b in PAIRS], ids=str)
def test_expert_switch_is_bitwise_and_minimal(src, dst):
    _simulate(src, dst)


def test_expert_bytes_lacking_by_hand():
    """(1,2,1,E=2) -> (1,2,1,E=1): each rank receives the other rank's two experts of each MoE
    layer and nothing else; the way back is free (each rank keeps what it already has)."""
    table = _simulate(Plan(1, 2, 1, E=2), Plan(1, 2, 1))
    expert_bytes = (2 * 16 * 32 + 32 * 16) * 4  # fc1 [2*16, 32] + fc2 [32, 16], fp32
    assert [table.bytes_received(r) for r in (0, 1)] == [3 * 2 * expert_bytes] * 2
    assert {op.param.split(".mlp.")[1].split(".linear")[0] for op in table.recvs(0)} == {
        "experts.local_experts.2", "experts.local_experts.3"}
    assert {op.src_local.split(".mlp.")[1].split(".linear")[0] for op in table.recvs(0)} == {
        "experts.local_experts.0", "experts.local_experts.1"}  # rank 1's local names
    back = _simulate(Plan(1, 2, 1), Plan(1, 2, 1, E=2))
    assert back.total_bytes() == 0


def test_expert_layout_errors():
    specs = gpt_param_specs(**MOE)
    with pytest.raises(PlanError, match="num_experts=4 is not divisible by E=3"):
        build_routing_table(specs, Plan(1, 3, 1, E=3), Plan(1, 3, 1))
    with pytest.raises(PlanError, match="moe_ffn_hidden_size=16 is not divisible by T=3"):
        build_routing_table(specs, Plan(1, 1, 3, ETP=3), Plan(1, 3, 1))


def test_moe_actor_may_generate_at_another_expert_layout():
    """The switch moves experts: a MoE actor trains at one E and generates at another."""
    from tests.unit.test_moe import _run_cfg

    for gen, want in ((["--actor-gen-expert-model-parallel-size", "1", "--actor-gen-pipeline-model-parallel-size", "2"],
                       "(P=2, D=2, T=1)"),
                      (["--actor-gen-expert-model-parallel-size", "4"], "(P=1, D=4, T=1, E=4)"),
                      (["--actor-gen-tensor-model-parallel-size", "2"], "(P=1, D=2, T=2, E=2)")):
        actor = _run_cfg("--expert-model-parallel-size", "2", *gen).roles["actor"]
        assert (str(actor.plan), str(actor.gen_plan)) == ("(P=1, D=4, T=1, E=2)", want), gen


def test_expert_optimizer_state_resumes_across_e1():
    """Experts keep an optimizer of their own at every E: a checkpoint's optimizer state resumes at
    any E; one saved at E = 1 without the mark (experts in the dense optimizer) takes
    --no-load-optim."""
    from types import SimpleNamespace

    from puzzle.checkpoint_metadata import EXPERTS_OWN_OPTIMIZER, _expert_optimizer_problems, run_metadata
    from tests.unit.test_moe import _run_cfg

    def problems(saved, *flags, load_optim=True):
        cfg = _run_cfg(*flags)
        cfg = SimpleNamespace(roles=cfg.roles, load_optim=load_optim)
        return _expert_optimizer_problems(cfg, "actor", saved)

    def saved(e, mark=True):
        mark = {"experts_optimizer": EXPERTS_OWN_OPTIMIZER} if mark else {}
        return {"plan": {"P": 1, "D": 4, "T": 1, "E": e}} | mark

    for e in (1, 2):
        assert problems(saved(e), "--expert-model-parallel-size", "4") == []
        assert problems(saved(e)) == []
        assert problems(saved(2, mark=False)) == []  # megatron kept experts apart at E > 1
    (msg,) = problems(saved(1, mark=False), "--expert-model-parallel-size", "2")
    assert msg.startswith("role actor: saved at E=1") and "--no-load-optim" in msg
    assert problems(saved(1, mark=False), load_optim=False) == []
    # checkpoints mark their trained MoE roles (the frozen reference has no optimizer)
    roles = run_metadata(_run_cfg())["roles"]
    assert [r.get("experts_optimizer") for r in (roles["actor"], roles["critic"], roles["ref"])] == [
        EXPERTS_OWN_OPTIMIZER, EXPERTS_OWN_OPTIMIZER, None]
